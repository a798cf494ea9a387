import sys

from dskit.train.entry import main

sys.exit(main())
