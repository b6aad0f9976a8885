"""The commands (run, regen, compare, check, metamorphic, calibrate, bisect, doctor): build lanes, run, judge,
report."""
