"""python -m care.evaluation.mteb_adapter ...: the command line (cli.main), bad input said in one line."""
import sys

from care.evaluation.mteb_adapter.cli import main

if __name__ == "__main__":
    import care  # noqa: F401  (registers the config resolvers)
    from care.config import BAD_INPUT

    try:
        main(sys.argv[1:])
    except BAD_INPUT as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
