"""``python -m shardscope.cli``: the command line."""

from shardscope.cli.main import main

if __name__ == "__main__":  # pragma: no cover
    main()
