"""The command line (typer): `app` is the ``kvstitch`` command (`main`); each subcommand lives in its own
module (`eval`, `store`, `serve`, `retrieval`, `viz`, `calibrate`).

`app` is looked up on first use, so ``python -m kvstitch.cli.eval`` runs its module without `main` having
imported it first."""


def __getattr__(name: str):
    if name == "app":
        from .main import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["app"]
