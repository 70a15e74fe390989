#!/usr/bin/env python3
"""Draws an amp_train metrics file (--metrics FILE.jsonl) into a PNG.

Four panels, sharing the step axis:
  loss           the training loss per step (each task's too, for --model mtl), and the validation
                 loss of the "eval" records (--model gpt --eval-every N);
  loss scale     the scale each step's backward used (log axis), the skipped steps marked;
  learning rate  the rate each step used;
  throughput     tokens/s or samples/s from step_ms when --samples-per-step is given (with
                 --tokens-per-sample for a language model), otherwise steps/s.
The title says how the run ended: its "end" record (steps, skipped steps, interrupted), a "failed"
record (its error), or neither (the run was still going, or died). A resumed run appends a "resume"
record to the file: the records of the run before it past the step it resumed from (its steps after
the checkpoint, lost) are left out.

    python3 launch/scripts/plot_metrics.py run.jsonl                      # writes run.png beside it
    python3 launch/scripts/plot_metrics.py build/example/metrics.jsonl --samples-per-step 32 --tokens-per-sample 64

A line that is not a JSON object, or whose fields have the wrong type, is skipped (one warning: how
many, and the first); a file that cannot be read or leaves no step to draw, and an --out that cannot
be written (no extension to tell the format, a directory, the metrics file itself), exit 2, before
matplotlib is needed. Needs matplotlib (Debian: python3-matplotlib); nothing else beyond Python 3.
"""
import argparse
import json
import math
import os
import stat
import sys


def is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def bad_fields(r):
    """Why a record cannot be drawn (a field of the wrong type), or None. null stands for inf/NaN."""
    if "step" in r and not (isinstance(r["step"], int) and not isinstance(r["step"], bool) and r["step"] >= 0):
        return "'step' is not a whole number >= 0"
    if r.get("event") == "eval" and "step" not in r:
        return "an eval record without 'step'"
    # Every step record of amp_train has its loss (null where it was not finite): a record without one
    # is another tool's (the emulated GPU's launch log has "step" records too).
    if "event" not in r and "step" in r and "loss" not in r:
        return "a step record without 'loss' (not an amp_train metrics file?)"
    for key in ("loss", "scale", "lr", "step_ms", "val_loss"):
        if r.get(key) is not None and not is_number(r[key]):
            return f"'{key}' is not a number or null"
    if not isinstance(r.get("skipped", False), bool):
        return "'skipped' is not true or false"
    tl = r.get("task_losses")
    if tl is not None and not (isinstance(tl, list) and all(v is None or is_number(v) for v in tl)):
        return "'task_losses' is not a list of numbers"
    return None


def read_metrics(path):
    """The step records, eval records and the last end/failed record of a metrics file, and the lines
    skipped: their count and the first one's number and reason."""
    steps, evals, ending = [], [], None
    skipped, first, back = 0, None, None
    # A FIFO (<(zcat run.jsonl.gz), /dev/stdin) is opened without waiting for a writer: with none, it
    # reads as empty, never hangs.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    with open(fd, "rb") as f:  # bytes: a stray non-UTF-8 byte spoils its line, not the file
        for n, raw in enumerate(f, 1):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except (ValueError, RecursionError) as e:
                # A run killed mid-write leaves no partial line, but a file may be read while written.
                why = f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else "not JSON"
                r = None
            else:
                why = bad_fields(r) if isinstance(r, dict) else "not a JSON object"
            if why:
                skipped += 1
                first = first or f"line {n}: {why}"
                continue
            event = r.get("event")
            if event == "resume" and isinstance(r.get("step"), int):
                # The run before stopped (or died) after the checkpoint it resumed from: its later
                # records are of steps trained again.
                steps = [x for x in steps if x["step"] <= r["step"]]
                evals = [x for x in evals if x["step"] <= r["step"]]
                ending = None
            elif event is None and "step" in r:
                if steps and r["step"] <= steps[-1]["step"] and back is None:
                    back = f"line {n}: step {r['step']} after step {steps[-1]['step']} with no resume record"
                steps.append(r)
            elif event == "eval":
                evals.append(r)
            elif event in ("end", "failed"):
                ending = r
    # A resumed run appends to the file: a step seen twice keeps its last record.
    by_step = {r["step"]: r for r in steps}
    steps = [by_step[s] for s in sorted(by_step)]
    by_step = {r["step"]: r for r in evals}
    evals = [by_step[s] for s in sorted(by_step)]
    return steps, evals, ending, skipped, first, back


def value(r, key):
    """A finite number, or None (JSON null stands for inf/NaN, and a key may be absent)."""
    v = r.get(key)
    try:
        return float(v) if is_number(v) and math.isfinite(v) else None
    except OverflowError:  # an integer too large for a float
        return None


def plotted(r, key):
    """value(r, key) as a point to draw: NaN (a gap) where there is none; 0.0 stays 0.0."""
    v = value(r, key)
    return float("nan") if v is None else v


def title_for(path, steps, ending):
    name = os.path.basename(path)
    if ending is None:
        return f"{name}: {len(steps)} steps (no end record: still running, or the run died)"
    if ending.get("event") == "failed":
        return f"{name}: FAILED after {ending.get('steps')} steps: {ending.get('error', '')}"[:160]
    t = f"{name}: {ending.get('steps')} steps, {ending.get('skipped_steps')} skipped"
    if ending.get("interrupted_by"):
        t += f", interrupted by {ending['interrupted_by']}"
    if ending.get("replicas_consistent") is False:
        t += ", REPLICAS DIFFER"
    return t


def main():
    ap = argparse.ArgumentParser(description="Draw an amp_train metrics file (JSON lines) into a PNG.")
    ap.add_argument("metrics", help="the metrics file (amp_train --metrics FILE.jsonl)")
    ap.add_argument("--out", help="the PNG to write (default: the metrics file's name with .png, beside it)")
    ap.add_argument("--samples-per-step", type=float,
                    help="samples per optimizer step (batch-size x micro-batches x ranks): throughput in "
                         "samples/s (or tokens/s with --tokens-per-sample) instead of steps/s")
    ap.add_argument("--tokens-per-sample", type=float,
                    help="tokens per sample (--block-size for --model gpt): throughput in tokens/s")
    a = ap.parse_args()
    if a.tokens_per_sample is not None and a.samples_per_step is None:
        ap.error("--tokens-per-sample needs --samples-per-step")
    for flag, v in (("--samples-per-step", a.samples_per_step), ("--tokens-per-sample", a.tokens_per_sample)):
        if v is not None and not (math.isfinite(v) and v > 0):
            ap.error(f"{flag} must be a positive number, got {v:g}")
    if a.out == "":
        ap.error("--out: an empty path (an unset variable?): give one, or leave the flag out")

    # The file first: bad input exits 2 whether or not matplotlib is there.
    try:
        if os.path.exists(a.metrics) and stat.S_ISCHR(os.stat(a.metrics).st_mode):
            print(f"plot_metrics: {a.metrics}: a device, not a metrics file", file=sys.stderr)  # /dev/zero
            sys.exit(2)
        steps, evals, ending, skipped, first, back = read_metrics(a.metrics)
    except OSError as e:
        print(f"plot_metrics: {a.metrics}: cannot read: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    if skipped:
        print(f"plot_metrics: {a.metrics}: skipped {skipped} line(s) that are not a JSON object or have a field "
              f"of the wrong type (the first: {first})", file=sys.stderr)
    if back:
        print(f"plot_metrics: {a.metrics}: the steps go back ({back}): two runs in one file? A step "
              f"drawn is its last record", file=sys.stderr)
    if not steps:
        print(f"plot_metrics: {a.metrics}: no step records to draw", file=sys.stderr)
        sys.exit(2)
    out = a.out or os.path.splitext(a.metrics)[0] + ".png"
    flag = "--out " if a.out else "the PNG "
    why = ("is a directory" if os.path.isdir(out)
           else "has no extension to say the format (.png, .svg, .pdf)" if not os.path.splitext(out)[1]
           else f"is in no directory ('{os.path.dirname(out)}' does not exist)"
           if os.path.dirname(out) and not os.path.isdir(os.path.dirname(out))
           else "is the metrics file itself: give --out" if os.path.exists(out) and os.path.samefile(out, a.metrics)
           else None)
    if why:
        print(f"plot_metrics: {flag}{out} {why}", file=sys.stderr)
        sys.exit(2)

    try:
        import matplotlib
        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_metrics: matplotlib is missing: install Debian's python3-matplotlib "
                 "(apt-get install python3-matplotlib, or launch/setup.sh --plot)")

    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    # The title holds the file's name and the run's error as they are: a '$' is no math, and what no
    # font draws (a control character, a lone surrogate from a JSON escape) becomes a '?'.
    title = "".join(c if c.isprintable() else "?" for c in title_for(a.metrics, steps, ending))
    fig.suptitle(title.replace("$", r"\$"), fontsize=10)

    # --- loss and validation loss
    ax = axes[0]
    loss = [value(r, "loss") for r in steps]
    ax.plot(x, [v if v is not None else float("nan") for v in loss], lw=0.8, label="loss")
    tasks = max((len(r.get("task_losses") or []) for r in steps), default=0)
    for t in range(tasks if tasks > 1 else 0):
        tl = [(r.get("task_losses") or [None] * tasks)[t] for r in steps]
        ax.plot(x, [v if isinstance(v, (int, float)) else float("nan") for v in tl], lw=0.6, alpha=0.7,
                label=f"task {t + 1}")
    if evals:
        ax.plot([r["step"] for r in evals], [plotted(r, "val_loss") for r in evals], "o-",
                ms=3, lw=1.2, label="validation loss")
    nonfinite = [s for s, v in zip(x, loss) if v is None]
    if nonfinite:
        ax.plot(nonfinite, [ax.get_ylim()[1]] * len(nonfinite), "rx", ms=4, label="loss not finite")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    # --- loss scale and skipped steps
    ax = axes[1]
    scale = [value(r, "scale") for r in steps]
    skipped = [r["step"] for r in steps if r.get("skipped")]
    if all(v == 1.0 for v in scale):
        ax.text(0.5, 0.5, "scale 1 throughout: no loss scaling", ha="center", va="center", transform=ax.transAxes)
    elif any(v is not None and v > 0 for v in scale):
        ax.plot(x, [v if v is not None and v > 0 else float("nan") for v in scale], lw=0.9, label="loss scale")
        ax.set_yscale("log", base=2)
        for s in skipped:
            ax.axvline(s, color="red", lw=0.6, alpha=0.5)
    else:
        ax.text(0.5, 0.5, "no finite positive scale to draw (a dry run's scale is 0)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("loss scale")
    ax.set_title(f"{len(skipped)} skipped steps" + (" (red lines)" if skipped else ""), fontsize=9)
    ax.grid(alpha=0.3)

    # --- learning rate
    ax = axes[2]
    ax.plot(x, [plotted(r, "lr") for r in steps], lw=0.9, color="tab:green")
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)

    # --- throughput from step_ms
    ax = axes[3]
    per_step, unit = 1.0, "steps/s"
    if a.samples_per_step:
        per_step, unit = a.samples_per_step, "samples/s"
        if a.tokens_per_sample:
            per_step, unit = a.samples_per_step * a.tokens_per_sample, "tokens/s"
    rate = [per_step * 1000.0 / r["step_ms"] if (value(r, "step_ms") or 0) > 0 else float("nan") for r in steps]
    ax.plot(x, rate, lw=0.5, alpha=0.5, color="tab:purple")
    finite = sorted(v for v in rate if math.isfinite(v))
    if finite:
        median = finite[len(finite) // 2]
        ax.axhline(median, color="black", lw=0.8, ls="--", label=f"median {median:,.0f} {unit}")
        ax.legend(fontsize=8)
        # The first steps (allocation, caches) are slow: keep the axis on the typical rate.
        ax.set_ylim(0, max(finite[int(len(finite) * 0.99)] * 1.1, median * 1.5))
    ax.set_ylabel(unit)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)

    fig.tight_layout(rect=(0, 0, 1, 0.97))
    try:
        fig.savefig(out, dpi=100)
    except OSError as e:  # a read-only folder, a full disk: the --out cannot be written
        print(f"plot_metrics: {flag}{out}: cannot be written: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    except ValueError as e:  # --out names a format matplotlib does not write
        print(f"plot_metrics: --out {out}: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"plot_metrics: {out}")


if __name__ == "__main__":
    main()
