// Package sns is fifobox's SNS FIFO / SQS FIFO transport, the default
// (FIFOBOX_TRANSPORT=sns), on the AWS SDK for Go v2 and aws-lambda-go. It
// implements pkg/transport's four parts, as the amqp and nats packages do:
//
//   - Publisher (outbox.Publisher): PublishBatch to one SNS FIFO topic,
//     MessageGroupId = aggregate id, MessageDeduplicationId = event id,
//     per-entry outcomes (nil, retryable, envelope.Permanent).
//   - Provisioner (Provision): the topic, and per consumer a FIFO queue with
//     its DLQ (redrive policy, maxReceiveCount) and a raw-delivery
//     subscription with the consumer's filter policy and its own DLQ. Make
//     local and the tests run it against the emulator; on AWS the CDK app
//     (infra/) creates the same resources from the same pkg/topology.
//   - The SQS event source: Handler is the consumer Lambda's batch handler
//     (events.SQSEvent in, partial batch failures out), the consumer engine
//     (inbox.Engine) over SQS records with this queue's DLQ; Runner is its local and
//     long-running stand-in for Lambda's event source mapping.
//   - Operations: queue, DLQ and subscription-DLQ depths, redrive from
//     either DLQ by receive-and-resend, replay sends to one consumer's queue.
//
// Transport bundles them for transport.Open, which registers this package
// under transport.SNS; its variables are Env.
package sns
