"""What the verifier stage's notebook shows: the tiny verifier's pretraining curve and how it answers."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt


def loss_curve(figures: dict[str, Any]):
    """The build's training loss against training tokens, the held-out loss as a line; None for other verifiers."""
    curve = figures.get("train_loss_curve")
    if not curve:
        return None
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([i * figures["train_tokens"] / len(curve) / 1e6 for i in range(len(curve))], curve)
    ax.axhline(figures["heldout_loss"], ls="--", c="gray",
               label=f"held-out loss (assistant tokens) {figures['heldout_loss']:.3f}")
    ax.set(xlabel="training tokens (M)", ylabel="loss", title="tiny verifier pretraining")
    ax.legend()
    return fig


def answers_markdown(answers: list[dict[str, Any]]) -> str:
    """Each answer: prompt, reasoning and content apart, its length and how it ended."""
    return "\n\n".join(
        f"**[{a['category']}, {a['mode']}] {a['prompt']}**  \n"
        f"*reasoning:* {a['reasoning'] or '(none)'}  \n*content:* {a['content']}  \n"
        f"<small>{a['completion_tokens']} tokens, finish_reason={a['finish_reason']}</small>"
        for a in answers) or "(no answers: verifier_report.serve is false)"
