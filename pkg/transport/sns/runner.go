package sns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/aws/aws-lambda-go/events"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
)

// BatchFunc is a Lambda SQS handler (Handler.Handle).
type BatchFunc func(ctx context.Context, ev events.SQSEvent) (events.SQSEventResponse, error)

// Runner is the SQS consumer as a long-running process (transport.Runner),
// a stand-in for Lambda's SQS event source mapping: it long-polls a queue,
// hands batches of up to 10 records to the same handler the Lambda runs,
// and deletes exactly the records not reported as failed.
// Failed records stay in flight and come back after the visibility timeout
// (or after RetryDelay, if set), so maxReceiveCount and the DLQ work as in AWS.
type Runner struct {
	SQS      SQSAPI
	QueueURL string
	QueueARN string
	Handler  BatchFunc
	// BatchSize is 1-10 (Lambda's FIFO limit). Default 10.
	BatchSize int
	// RetryDelay, if > 0, makes failed records visible again after this
	// long instead of the queue's visibility timeout (faster local retries).
	RetryDelay time.Duration
	// HandlerTimeout is each batch's deadline, like the consumer function's
	// timeout. A batch in hand is finished even if Run's context is cancelled,
	// as a Lambda invocation runs to completion once started, so stopping
	// neither fails records nor leaves them in flight. Default 30s.
	HandlerTimeout time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// Run polls until ctx is done.
func (r *Runner) Run(ctx context.Context) error {
	if r.SQS == nil || r.QueueURL == "" || r.Handler == nil {
		return errors.New("sqs runner: SQS, QueueURL and Handler are required")
	}
	log := r.Logger
	if log == nil {
		log = slog.Default()
	}
	for ctx.Err() == nil {
		if _, err := r.Poll(ctx, 1); err != nil && ctx.Err() == nil {
			log.Warn("sqs runner: poll failed", "queue", r.QueueURL, "error", err.Error())
			time.Sleep(200 * time.Millisecond)
		}
	}
	return nil
}

// Poll receives one batch (waiting up to waitSeconds), runs the handler and
// settles the records. It returns how many records it received.
func (r *Runner) Poll(ctx context.Context, waitSeconds int32) (int, error) {
	n := r.BatchSize
	if n <= 0 || n > 10 {
		n = 10
	}
	out, err := r.SQS.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
		QueueUrl: aws.String(r.QueueURL), MaxNumberOfMessages: int32(n), WaitTimeSeconds: waitSeconds,
		MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameAll},
		MessageAttributeNames:       []string{"All"},
	})
	if err != nil {
		return 0, fmt.Errorf("receive: %w", err)
	}
	if len(out.Messages) == 0 {
		return 0, nil
	}
	ev := events.SQSEvent{Records: make([]events.SQSMessage, len(out.Messages))}
	byID := map[string]sqstypes.Message{}
	for i, m := range out.Messages {
		ev.Records[i] = toRecord(m, r.QueueARN)
		byID[aws.ToString(m.MessageId)] = m
	}
	timeout := r.HandlerTimeout
	if timeout <= 0 {
		timeout = 30 * time.Second
	}
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	resp, herr := r.Handler(hctx, ev)
	failed := map[string]bool{}
	if herr != nil {
		// A returned error fails the whole batch, as in Lambda.
		for id := range byID {
			failed[id] = true
		}
	} else {
		for _, f := range resp.BatchItemFailures {
			if _, ok := byID[f.ItemIdentifier]; !ok {
				return len(out.Messages), fmt.Errorf("handler reported unknown item identifier %q", f.ItemIdentifier)
			}
			failed[f.ItemIdentifier] = true
		}
	}
	var del []sqstypes.DeleteMessageBatchRequestEntry
	var retry []sqstypes.ChangeMessageVisibilityBatchRequestEntry
	for i, m := range out.Messages {
		id := aws.ToString(m.MessageId)
		if failed[id] {
			retry = append(retry, sqstypes.ChangeMessageVisibilityBatchRequestEntry{
				Id: aws.String(strconv.Itoa(i)), ReceiptHandle: m.ReceiptHandle, VisibilityTimeout: int32(r.RetryDelay / time.Second)})
			continue
		}
		del = append(del, sqstypes.DeleteMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), ReceiptHandle: m.ReceiptHandle})
	}
	if len(del) > 0 {
		// Deletion is detached from ctx: a handled record must not be redelivered because we are stopping.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		if _, err := r.SQS.DeleteMessageBatch(dctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(r.QueueURL), Entries: del}); err != nil {
			return len(out.Messages), fmt.Errorf("delete handled records: %w", err)
		}
	}
	if len(retry) > 0 && r.RetryDelay > 0 {
		_, _ = r.SQS.ChangeMessageVisibilityBatch(context.WithoutCancel(ctx), &sqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(r.QueueURL), Entries: retry})
	}
	return len(out.Messages), nil
}

func toRecord(m sqstypes.Message, queueARN string) events.SQSMessage {
	rec := events.SQSMessage{
		MessageId: aws.ToString(m.MessageId), ReceiptHandle: aws.ToString(m.ReceiptHandle), Body: aws.ToString(m.Body),
		Md5OfBody: aws.ToString(m.MD5OfBody), Attributes: map[string]string{}, MessageAttributes: map[string]events.SQSMessageAttribute{},
		EventSource: "aws:sqs", EventSourceARN: queueARN, AWSRegion: "us-east-1",
	}
	for k, v := range m.Attributes {
		rec.Attributes[k] = v
	}
	for k, v := range m.MessageAttributes {
		rec.MessageAttributes[k] = events.SQSMessageAttribute{StringValue: v.StringValue, DataType: aws.ToString(v.DataType)}
	}
	return rec
}
