"""``python -m attnlab`` (also what ``torchrun -m attnlab`` runs)."""

from attnlab.cli import main

if __name__ == "__main__":
    main()
