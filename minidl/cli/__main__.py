"""`python -m minidl.cli ...`: the `minidl` command (mpiexec starts ranks this way)."""
import sys

from . import main

sys.exit(main())
