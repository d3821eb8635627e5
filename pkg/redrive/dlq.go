package redrive

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
)

// dlqRedrive moves up to Max messages from the consumer's DLQ back to its
// queue: receive a batch (one group's messages arrive in order, and the group
// stays locked while they are in flight), send them to the queue in the same
// order with the same MessageGroupId, body and attributes (minus the
// inbox's fifobox_error_* diagnostics) and a fresh deduplication id, then
// delete them from the DLQ. A crash between send and delete re-sends on the
// next run: the consumer's inbox drops the duplicate.
func (s *Service) dlqRedrive(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	q, err := s.queues(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("dlq-redrive: %w", err)
	}
	if cmd.DryRun {
		d := s.depth(ctx, cmd.Consumer, q)
		if d.Error != "" {
			return res, fmt.Errorf("dlq-redrive: %s", d.Error)
		}
		res.Affected = min(d.DLQ, int64(cmd.Max))
		res.Message = fmt.Sprintf("would move %d of about %d messages (%d in flight) from the DLQ of %s", res.Affected, d.DLQ, d.DLQInFlight, cmd.Consumer)
		return res, nil
	}
	auditID, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return res, err
	}
	res.AuditID = auditID
	total := int64(-1)
	if d := s.depth(ctx, cmd.Consumer, q); d.Error == "" {
		total = min(d.DLQ, int64(cmd.Max))
	}
	var moved int64
	opErr := func() error {
		empties := 0
		for moved < int64(cmd.Max) && empties < 2 {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("stopped after %d messages: %w", moved, err)
			}
			out, err := s.sqs.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
				QueueUrl:                    aws.String(q.DLQURL),
				MaxNumberOfMessages:         int32(min(sqsBatchSize, int64(cmd.Max)-moved)),
				WaitTimeSeconds:             1,
				VisibilityTimeout:           60,
				MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameMessageGroupId},
				MessageAttributeNames:       []string{"All"},
			})
			if err != nil {
				return fmt.Errorf("receive from DLQ: %w", err)
			}
			if len(out.Messages) == 0 {
				empties++
				continue
			}
			empties = 0
			entries := make([]sqstypes.SendMessageBatchRequestEntry, len(out.Messages))
			dels := make([]sqstypes.DeleteMessageBatchRequestEntry, len(out.Messages))
			for i, m := range out.Messages {
				group := m.Attributes[string(sqstypes.MessageSystemAttributeNameMessageGroupId)]
				if group == "" {
					return fmt.Errorf("DLQ message %s has no MessageGroupId (is the DLQ a FIFO queue?)", aws.ToString(m.MessageId))
				}
				attrs := map[string]sqstypes.MessageAttributeValue{}
				for k, v := range m.MessageAttributes {
					if strings.HasPrefix(k, "fifobox_error_") {
						continue
					}
					attrs[k] = v
				}
				entries[i] = sqstypes.SendMessageBatchRequestEntry{
					Id:                     aws.String("m" + strconv.Itoa(i)),
					MessageBody:            m.Body,
					MessageGroupId:         aws.String(group),
					MessageDeduplicationId: aws.String(fmt.Sprintf("redrive-%d-%s", auditID, aws.ToString(m.MessageId))),
					MessageAttributes:      attrs,
				}
				dels[i] = sqstypes.DeleteMessageBatchRequestEntry{Id: aws.String("m" + strconv.Itoa(i)), ReceiptHandle: m.ReceiptHandle}
			}
			if err := sendBatch(ctx, s.sqs, q.QueueURL, entries); err != nil {
				// Nothing deleted: the messages reappear in the DLQ after the visibility timeout.
				return err
			}
			dout, err := s.sqs.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(q.DLQURL), Entries: dels})
			if err != nil {
				return fmt.Errorf("delete from DLQ (messages were re-sent; the inbox drops duplicates): %w", err)
			}
			if len(dout.Failed) > 0 {
				return fmt.Errorf("delete from DLQ: %d entries failed (re-sent; the inbox drops duplicates)", len(dout.Failed))
			}
			moved += int64(len(out.Messages))
			s.progress(cmd.Operation, moved, total)
		}
		return nil
	}()
	res.Affected = moved
	if err := s.auditFinish(ctx, auditID, cmd, moved, opErr); err != nil && opErr == nil {
		opErr = err
	}
	if opErr != nil {
		return res, fmt.Errorf("dlq-redrive: %w", opErr)
	}
	res.Message = fmt.Sprintf("moved %d messages from the DLQ of %s back to its queue", moved, cmd.Consumer)
	return res, nil
}
