"""Closed-loop evaluation (issue 15): scenarios, the ego vehicle, policies, episodes, metrics report and clips of `stack drive`."""
