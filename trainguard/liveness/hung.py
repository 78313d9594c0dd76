"""A hung rank in a supervised job (trainguard.supervise): the watchdog of the live ranks names it, its
process ends -- killed on its host at once, by its supervisor elsewhere -- and a spare takes its place through the
survivors' usual way (trainguard.liveness.replacement), instead of every rank exiting for a restart. A rank left behind in
an old generation (blocked while the others formed the next) fails its collective by its groups' connections
shut, or ends for a spare."""
from __future__ import annotations

import sys
from typing import Any, Callable

from trainguard.events import Record


def _end_if_left_behind(rank: int, gen: int) -> None:
    """This process still in generation ``gen`` (its collective did not fail): its stacks, then its end."""
    import faulthandler
    import os

    from trainguard.ranks.attempt import generation

    if generation() == gen:
        print(f"[trainguard rank {rank}] still in generation {gen} after its groups' connections were shut: this "
              "process ends for a spare; its stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os.kill(os.getpid(), 9)


def replacing_hung(watchdog, verdict, kill_local: Callable[[], Any]) -> bool:
    """The watchdog's hung ranks in a supervised job (on every live rank; trainguard.liveness.watchdog): their processes end --
    killed on this host at once, by their supervisors elsewhere -- and spares take their places, instead of every
    rank exiting for a restart. Asked once per watchdog. False: not supervised."""
    from trainguard.liveness.world import Ledger, World

    if not World.supervised():
        return False
    if getattr(watchdog, "replacing", False):
        return True
    watchdog.replacing = True
    import os

    from trainguard.ranks.attempt import generation

    ledger = Ledger.connect()
    if ledger.generation() > generation():
        # the world moved on without this rank: a replacement is under way (the others, rebuilding, are silent),
        # and this rank is still blocked in the old world. Its groups' connections shut down, its collective fails
        # and it joins the next generation like any survivor; where none could be (no world here), the process
        # ends, as if killed, and a spare -- or the job's restart -- takes it
        world = World.current
        severed = world.sever() if world is not None else 0
        print(f"[trainguard rank {watchdog.rank}] blocked in generation {generation()} while the world formed "
              f"generation {ledger.generation()}: " + (f"{severed} connections of its groups shut down, its "
              "collective fails and it joins the next generation" if severed else "this process ends for a spare; "
              "its stacks:"), file=sys.stderr, flush=True)
        if severed:  # (and if this rank was stuck elsewhere, it ends after all -- as below -- for a spare)
            import threading

            gen = generation()
            timer = threading.Timer(watchdog.cfg.distributed.watchdog.hang_timeout_s, _end_if_left_behind,
                                    args=(watchdog.rank, gen))  # (nothing of the old run held meanwhile)
            timer.daemon = True
            timer.start()
            return True
        import faulthandler

        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os.kill(os.getpid(), 9)
    w, live = watchdog.cfg.distributed.watchdog, [r for r in range(watchdog.world) if r not in verdict.culprits]
    first = bool(live) and watchdog.rank == live[0]
    watchdog.guard.emit(watchdog.heart.step, Record.HANG_DETECTED, verdict.culprits, "replace", {
        "culprits": [dict(c, coords=watchdog.guard.coords_of(c["rank"])) for c in verdict.describe()],
        "why": verdict.why, "hang_timeout_s": w.hang_timeout_s, "detected_by": watchdog.rank},
        rank_local=True, to_run_log=first, takeover=first)
    if first:
        for r in verdict.culprits:
            ledger.request_kill(r)
    kill_local()
    return True
