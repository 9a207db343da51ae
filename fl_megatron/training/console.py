"""What rank 0 prints: the start-up banner and one progress line per logged step."""

import sys


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def progress_line(record: dict, total_steps: int, eta_seconds: float) -> str:
    """One line: step/total, loss, lr, tokens/s, sync, ETA."""
    parts = [f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"grad {record['grad_norm']:.3f}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if record.get("synced"):
        parts.append(f"sync {record['sync_seconds'] * 1e3:.0f} ms var {record['param_variance']:.2e}")
    parts.append(f"ETA {format_duration(eta_seconds)}")
    return " | ".join(parts)


def say(text: str, enabled: bool = True) -> None:
    if enabled:
        print(text, file=sys.stdout, flush=True)
