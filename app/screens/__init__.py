"""Dialogs and overlays on top of the dashboard."""
