"""``python -m trainguard.supervise``: the supervisor a job with hot spares is launched under, by the name users type
(``torchrun ... -m trainguard.supervise --spares 1 -- train.py``); it lives in trainguard.liveness.supervise."""
import sys

from trainguard.liveness.supervise import main

if __name__ == "__main__":
    sys.exit(main())
