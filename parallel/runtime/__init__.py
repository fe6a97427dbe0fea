"""The process around the ranks: launch, devices, the watchdog, failures, memory."""
