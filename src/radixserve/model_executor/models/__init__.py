"""radixserve.model_executor.models"""
