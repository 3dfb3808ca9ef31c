"""stack: an end-to-end autonomy perception/planning reference stack.

One pipeline definition (`stack.pipeline.Pipeline`) drives every stage: rendered
sensor data (`stack.data`), the multi-task BEV network (`stack.models`), training
(`stack.train`) and deployment to quantized real-time engines (`stack.deploy`).

Importing `stack` is cheap on purpose: it loads no deep-learning framework, no
data loader and no CUDA context; stages import what they need when they run.
"""

__version__ = "0.1.0"
