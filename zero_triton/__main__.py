import sys

from zero_triton.cli import main

sys.exit(main())
