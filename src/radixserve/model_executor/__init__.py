"""radixserve.model_executor"""
