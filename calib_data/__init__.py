"""Named calibration/evaluation datasets, as data (`shortcuts.yaml`); installed as
`quantlab.calib_data`. Real text is never stored here: shortcuts point at the hub."""
