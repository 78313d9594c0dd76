"""Test-only: which steps a worker decided at the update's launch (trainguard.step.launchgate) -- LaunchGate.run
wrapped in the worker's process, each call's ``reached`` appended to the list returned."""


def watch_launches() -> list:
    from trainguard.step import launchgate

    reached: list = []
    run = launchgate.LaunchGate.run

    def spy(self, decide, base_step):
        out = run(self, decide, base_step)
        reached.append(out[2])
        return out
    launchgate.LaunchGate.run = spy
    return reached
