"""The torch server example (a package only so that its module names stay its own)."""
