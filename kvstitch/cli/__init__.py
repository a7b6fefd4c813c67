"""The command line (typer): `app` is the ``kvstitch`` command (`main`); each larger subcommand lives in its
own module (`demo`, `bench`, `eval`, `store`, `serve`, `retrieval`, `viz`, `calibrate`), the options several
commands share in `options` and the helpers they share in `common`.

`app` is looked up on first use, so ``python -m kvstitch.cli.eval`` runs its module without `main` having
imported it first."""


def __getattr__(name: str):
    if name == "app":
        from .main import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["app"]
