"""When the federation groups are averaged."""


def sync_due(step: int, interval: int, last: bool, federated: bool = True) -> bool:
    """Whether to average after optimizer step `step` (1-based count of completed steps).

    Every `interval` steps and after the last step; never when there is a single group or
    the interval is 0 (syncing disabled).
    """
    if step < 1:
        raise ValueError(f"step={step} must count completed optimizer steps from 1")
    if not federated or interval <= 0:
        return False
    return step % interval == 0 or last
