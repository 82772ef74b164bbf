"""tokentop's look: the stylesheet (tokentop.tcss) and its dark and light themes.

The stylesheet uses theme variables only ($primary, $surface, ... plus the kv-* ones below,
which have defaults), so every Textual theme works with it, including the built-in ones
offered by the command palette.
"""
from __future__ import annotations

from pathlib import Path

from textual.theme import Theme

STYLESHEET = Path(__file__).with_name("tokentop.tcss")

# Colours of the KV page grid; the dark ones are also the defaults for themes without them.
KV_DEFAULTS = {"kv-used": "#3fa7d6", "kv-shared": "#e0a030", "kv-cached": "#59c27a"}

DARK = Theme(
    name="tokentop-dark",
    primary="#3fa7d6",
    secondary="#7d5fff",
    accent="#e0a030",
    warning="#e0a030",
    error="#e5534b",
    success="#59c27a",
    foreground="#d8dee9",
    background="#10141b",
    surface="#171c25",
    panel="#1f2633",
    dark=True,
    variables=KV_DEFAULTS,
)

LIGHT = Theme(
    name="tokentop-light",
    primary="#1f6fa8",
    secondary="#6a4fd8",
    accent="#b86e00",
    warning="#b86e00",
    error="#c4302b",
    success="#2e8b4a",
    foreground="#1d2330",
    background="#f6f4ef",
    surface="#ece9e2",
    panel="#dedad0",
    dark=False,
    variables={"kv-used": "#1f6fa8", "kv-shared": "#b86e00", "kv-cached": "#2e8b4a"},
)

THEMES = (DARK, LIGHT)
