"""`python -m torch_runner.serve`: see torch_runner/serve/cli.py (or `--help`)."""

from torch_runner.serve.cli import main

if __name__ == "__main__":
    main()
