import sys

from zero_triton.tools.checkpoint import main
from zero_triton.tools.console import run

sys.exit(run(main))
