"""stack.deploy: ONNX export, INT8 QDQ per target, engines, accuracy and FPS gates, reports."""
