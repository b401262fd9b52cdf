"""Named, model-specific schedules: ``schedules/<name>.py`` defines ``apply(sch, config, args)``."""
