"""What a run tells: logs, metrics, TensorBoard, MLPerf log, step times, traces."""
