"""Dashboard preferences remembered between runs (today: the theme), in one small JSON file.

A missing, unreadable or corrupt file means "defaults": preferences must never stop the
dashboard from opening.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from platformdirs import user_config_dir

DEFAULT_THEME = "tokentop-dark"


@dataclass
class Settings:
    theme: str = DEFAULT_THEME


def default_settings_path() -> Path:
    return Path(user_config_dir("tokentop")) / "settings.json"


def load_settings(path: Path | None = None) -> Settings:
    path = path or default_settings_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return Settings()
    if not isinstance(data, dict):
        return Settings()
    theme = data.get("theme")
    return Settings(theme=theme if isinstance(theme, str) and theme else DEFAULT_THEME)


def save_settings(settings: Settings, path: Path | None = None) -> None:
    """Write atomically (temp file + rename) so a crash never leaves half a file behind."""
    path = path or default_settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(settings), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
