"""Side package: pure cost functions (memory now; communication and time later) for the planner.

Nothing here touches a process group or a device: every function maps numbers to
numbers, so the planner, the strategies' own accounting and the unit tests share them.
"""
