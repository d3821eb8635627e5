package sns

import (
	"context"

	snssvc "github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
)

// SNSAPI is the part of the SNS client this transport uses (publishing
// and provisioning); *snssvc.Client satisfies it.
type SNSAPI interface {
	PublishBatch(ctx context.Context, in *snssvc.PublishBatchInput, optFns ...func(*snssvc.Options)) (*snssvc.PublishBatchOutput, error)
	CreateTopic(ctx context.Context, in *snssvc.CreateTopicInput, optFns ...func(*snssvc.Options)) (*snssvc.CreateTopicOutput, error)
	Subscribe(ctx context.Context, in *snssvc.SubscribeInput, optFns ...func(*snssvc.Options)) (*snssvc.SubscribeOutput, error)
}

// SQSAPI is the part of the SQS client this transport uses (the consumer
// runner, operations and provisioning); *sqs.Client satisfies it. The
// consumer's handler needs only DLQSender.
type SQSAPI interface {
	DLQSender
	ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, optFns ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error)
	SendMessageBatch(ctx context.Context, in *sqs.SendMessageBatchInput, optFns ...func(*sqs.Options)) (*sqs.SendMessageBatchOutput, error)
	DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, optFns ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error)
	ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, optFns ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error)
	GetQueueAttributes(ctx context.Context, in *sqs.GetQueueAttributesInput, optFns ...func(*sqs.Options)) (*sqs.GetQueueAttributesOutput, error)
	GetQueueUrl(ctx context.Context, in *sqs.GetQueueUrlInput, optFns ...func(*sqs.Options)) (*sqs.GetQueueUrlOutput, error)
	CreateQueue(ctx context.Context, in *sqs.CreateQueueInput, optFns ...func(*sqs.Options)) (*sqs.CreateQueueOutput, error)
}
