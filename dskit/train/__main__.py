"""`python -m dskit.train`: the trainer's process (dskit/train/entry.py). A run that ended leaves without the
interpreter's teardown (dskit/launch/torchrun.py `exit_without_teardown`): its files are closed and its exit
code recorded by then. Bad input (exit 2) leaves the usual way: a rank refused at start gains nothing from a
quicker exit, and the usual one leaves its peers the time to say their own line before the launcher stops
them. An exception ends the usual way too, with its traceback."""

import sys

from dskit.errors import EXIT_BAD_INPUT
from dskit.host.extras import refused
from dskit.launch.torchrun import exit_without_teardown
from dskit.train.entry import main

if (refusal := refused("python -m dskit.train", "train")) is not None:
    sys.exit(refusal)
code = main()
if code == EXIT_BAD_INPUT:
    sys.exit(code)
exit_without_teardown(code)
