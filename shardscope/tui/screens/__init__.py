"""The app's screens: presets, dashboard, report, and small dialogs."""
