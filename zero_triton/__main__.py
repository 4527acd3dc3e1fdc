import sys

from zero_triton.tools.cli import main

sys.exit(main())
