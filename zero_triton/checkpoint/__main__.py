import sys

from zero_triton.checkpoint import main
from zero_triton.tools.cli import run

sys.exit(run(main))
