"""Worker: appends run-log events in a tight loop, forever, until it is killed.

usage: runlog_append.py DIR
Prints "job <id>" first, then the step of each event once its append returned (flushed), so
the parent knows which lines must have survived a SIGKILL. One line in 16 carries up to 12 KiB
of padding, so a kill can land in the middle of a write that spans pages.
"""

import random
import sys

from jaxckpt._src.goodput.runlog import RunLog
from jaxckpt._src.storage import location


def main(directory: str) -> None:
    log = RunLog([location(directory)], 0)
    rng = random.Random()
    print("job", log.job, flush=True)
    step = 0
    while True:
        big = rng.randrange(16) == 0  # a line over two pages now and then, short ones else
        log.append("step", step, pad="x" * rng.randrange(12 << 10 if big else 64))
        print(step, flush=True)
        step += 1


if __name__ == "__main__":
    main(sys.argv[1])
