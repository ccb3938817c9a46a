"""Pipeline parallelism: layer partition, stage-boundary tensors, point-to-point transfer.

partition.py  decoder layers per stage (vLLM's rule, VLLM_PP_LAYER_PARTITION)
tensors.py    IntermediateTensors (hidden + residual), PPMissingLayer (a layer another stage holds)
stage.py      PipelineStage: this rank's place (pp/tp rank), send/recv to the neighbour stages
kv.py         this stage's share of the engine-wide KVCacheConfig
"""
