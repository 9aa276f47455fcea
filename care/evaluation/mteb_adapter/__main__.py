"""python -m care.evaluation.mteb_adapter ...: the command line (cli.main), errors said in one line
(care.errors.app_errors)."""
import sys

from care.evaluation.mteb_adapter.cli import APP, main

if __name__ == "__main__":
    import care  # noqa: F401  (registers the config resolvers)
    from care.errors import app_errors

    with app_errors(APP):
        main(sys.argv[1:])
