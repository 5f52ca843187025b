"""What the daemon says about itself: metrics, the stage timeline, the clock of
progress."""
