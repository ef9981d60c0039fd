"""Time model: roofline compute, alpha-beta communication on the cluster's link levels, and the
pipeline schedule that turns stage times into a step time."""
