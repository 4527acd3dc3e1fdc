import sys

from zero_triton.checkpoint import main
from zero_triton.cli import run

sys.exit(run(main))
