"""`python -m vase.cli ...` (and `torchrun -m vase.cli eval ...`): the `vase` command."""

from vase.cli.main import main

if __name__ == "__main__":
    main()
