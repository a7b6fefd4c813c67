"""Running an app in a background thread on a loopback port: the tests, the serving load bench
(`kvstitch.bench.serve`) and notebooks start a real server with it."""

import socket
import threading
import time


class ServerThread:
    """Run an app with uvicorn in a background thread on a loopback port (tests, notebooks).

        with ServerThread(app) as srv:
            httpx.get(f"{srv.url}/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        from kvstitch.core.extras import require

        uvicorn = require("uvicorn", "serve", "the kvstitch server")

        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=5, backlog=512))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       name="kvstitch-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > timeout:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
