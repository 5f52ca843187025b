"""The ports (`worker.ports`) made real: AWS (SQS, S3, SNS, Auto Scaling, ECS, instance
metadata) and in-memory fakes with the same semantics."""
