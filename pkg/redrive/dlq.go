package redrive

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
)

// snsErrorAttributes are what SNS adds to a message it dead-letters from a
// subscription; they describe the failed delivery, not the event.
var snsErrorAttributes = map[string]bool{"ErrorCode": true, "ErrorMessage": true, "RequestID": true}

// dlqRedrive moves up to Max messages from the consumer's DLQ (or its SNS
// subscription's DLQ) back to its queue: receive a batch (one group's
// messages arrive in order, and the group stays locked while they are in
// flight), send them to the queue in the same order with the same
// MessageGroupId, body and attributes (minus the fifobox_error_* and SNS
// delivery-error diagnostics) and a fresh deduplication id, then delete them
// from the DLQ. A crash between send and delete re-sends on the next run:
// the consumer's inbox drops the duplicate.
//
// Only messages that were in the DLQ when the redrive started move: a
// message dead-lettered again meanwhile (still failing, or held behind one
// that is) stays for the next redrive, with its group's later messages, so
// a redrive ends instead of cycling messages between the queues.
//
// A subscription DLQ holds what SNS could not deliver. With raw delivery
// its messages are the published ones; a body in SNS's notification JSON
// is unwrapped to the published message and attributes.
func (s *Service) dlqRedrive(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	q, err := s.queues(cmd.Consumer)
	if err != nil {
		return res, fmt.Errorf("dlq-redrive: %w", err)
	}
	if s.cfg.Broker != nil {
		return s.brokerRedrive(ctx, cmd)
	}
	source, from := q.DLQURL, "the DLQ"
	if cmd.Source == SourceSubscriptionDLQ {
		if q.SubscriptionDLQURL == "" {
			return res, fmt.Errorf("dlq-redrive: consumer %q has no subscription_dlq_url in FIFOBOX_QUEUES", cmd.Consumer)
		}
		source, from = q.SubscriptionDLQURL, "the subscription DLQ"
	}
	if cmd.DryRun {
		visible, inFlight, err := s.queueDepth(ctx, source)
		if err != nil {
			return res, fmt.Errorf("dlq-redrive: %w", err)
		}
		res.Affected = min(visible, int64(cmd.Max))
		res.Message = fmt.Sprintf("would move %d of about %d messages (%d in flight) from %s of %s", res.Affected, visible, inFlight, from, cmd.Consumer)
		return res, nil
	}
	auditID, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return res, err
	}
	res.AuditID = auditID
	total := int64(-1)
	if visible, _, err := s.queueDepth(ctx, source); err == nil {
		total = min(visible, int64(cmd.Max))
	}
	// SQS's clock stamps SentTimestamp. Skew between it and ours is small;
	// its only effect is that a message dead-lettered again within that
	// skew is moved once more (harmless: the inbox and the holds keep
	// order and exactly-once).
	cutoff := time.Now()
	stopped := map[string]bool{} // groups whose next message is newer than the cutoff
	var moved, left int64
	opErr := func() error {
		empties := 0
		for moved < int64(cmd.Max) && empties < 2 {
			if err := ctx.Err(); err != nil {
				return fmt.Errorf("stopped after %d messages: %w", moved, err)
			}
			out, err := s.sqs.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
				QueueUrl:            aws.String(source),
				MaxNumberOfMessages: int32(min(sqsBatchSize, int64(cmd.Max)-moved)),
				WaitTimeSeconds:     1,
				VisibilityTimeout:   60,
				MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameMessageGroupId,
					sqstypes.MessageSystemAttributeNameSentTimestamp},
				MessageAttributeNames: []string{"All"},
			})
			if err != nil {
				return fmt.Errorf("receive from %s: %w", from, err)
			}
			var entries []sqstypes.SendMessageBatchRequestEntry
			var dels []sqstypes.DeleteMessageBatchRequestEntry
			for i, m := range out.Messages {
				group := m.Attributes[string(sqstypes.MessageSystemAttributeNameMessageGroupId)]
				if group == "" {
					return fmt.Errorf("message %s in %s has no MessageGroupId (is it a FIFO queue?)", aws.ToString(m.MessageId), from)
				}
				if stopped[group] || sentAfter(m, cutoff) {
					// Dead-lettered after the redrive started: it and the
					// rest of its group stay (invisible for the receive's
					// visibility timeout, so this run does not see them again).
					stopped[group] = true
					left++
					continue
				}
				body, attrs := redriven(m, cmd.Source == SourceSubscriptionDLQ)
				id := "m" + strconv.Itoa(i)
				entries = append(entries, sqstypes.SendMessageBatchRequestEntry{
					Id:                     aws.String(id),
					MessageBody:            aws.String(body),
					MessageGroupId:         aws.String(group),
					MessageDeduplicationId: aws.String(fmt.Sprintf("redrive-%d-%s", auditID, aws.ToString(m.MessageId))),
					MessageAttributes:      attrs,
				})
				dels = append(dels, sqstypes.DeleteMessageBatchRequestEntry{Id: aws.String(id), ReceiptHandle: m.ReceiptHandle})
			}
			if len(entries) == 0 {
				empties++
				continue
			}
			empties = 0
			if err := sendBatch(ctx, s.sqs, q.QueueURL, entries); err != nil {
				// Nothing deleted: the messages reappear in the DLQ after the visibility timeout.
				return err
			}
			dout, err := s.sqs.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(source), Entries: dels})
			if err != nil {
				return fmt.Errorf("delete from %s (messages were re-sent; the inbox drops duplicates): %w", from, err)
			}
			if len(dout.Failed) > 0 {
				return fmt.Errorf("delete from %s: %d entries failed (re-sent; the inbox drops duplicates)", from, len(dout.Failed))
			}
			moved += int64(len(entries))
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
	res.Message = fmt.Sprintf("moved %d messages from %s of %s back to its queue", moved, from, cmd.Consumer)
	if left > 0 {
		res.Message += fmt.Sprintf("; %d dead-lettered again during the redrive stay for the next one", left)
	}
	return res, nil
}

func sentAfter(m sqstypes.Message, cutoff time.Time) bool {
	ms, err := strconv.ParseInt(m.Attributes[string(sqstypes.MessageSystemAttributeNameSentTimestamp)], 10, 64)
	return err == nil && time.UnixMilli(ms).After(cutoff)
}

// snsNotification is the JSON SNS delivers when raw delivery is off.
type snsNotification struct {
	Type              string `json:"Type"`
	Message           string `json:"Message"`
	TopicArn          string `json:"TopicArn"`
	MessageAttributes map[string]struct {
		Type  string `json:"Type"`
		Value string `json:"Value"`
	} `json:"MessageAttributes"`
}

// redriven returns the body and attributes to send back to the queue.
func redriven(m sqstypes.Message, fromSubscription bool) (string, map[string]sqstypes.MessageAttributeValue) {
	body := aws.ToString(m.Body)
	attrs := map[string]sqstypes.MessageAttributeValue{}
	if fromSubscription {
		var n snsNotification
		if json.Unmarshal([]byte(body), &n) == nil && n.Type == "Notification" && n.TopicArn != "" {
			for k, v := range n.MessageAttributes {
				if v.Type == "String" || v.Type == "Number" {
					attrs[k] = sqstypes.MessageAttributeValue{DataType: aws.String(v.Type), StringValue: aws.String(v.Value)}
				}
			}
			return n.Message, attrs
		}
	}
	for k, v := range m.MessageAttributes {
		if strings.HasPrefix(k, "fifobox_error_") || (fromSubscription && snsErrorAttributes[k]) {
			continue
		}
		attrs[k] = v
	}
	return body, attrs
}

func (s *Service) queueDepth(ctx context.Context, url string) (visible, inFlight int64, err error) {
	out, err := s.sqs.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: aws.String(url),
		AttributeNames: []sqstypes.QueueAttributeName{sqstypes.QueueAttributeNameApproximateNumberOfMessages,
			sqstypes.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
	if err != nil {
		return 0, 0, err
	}
	visible, _ = strconv.ParseInt(out.Attributes[string(sqstypes.QueueAttributeNameApproximateNumberOfMessages)], 10, 64)
	inFlight, _ = strconv.ParseInt(out.Attributes[string(sqstypes.QueueAttributeNameApproximateNumberOfMessagesNotVisible)], 10, 64)
	return visible, inFlight, nil
}

// brokerRedrive is dlq-redrive through another transport's broker
// (Config.Broker), which moves the messages back in the order they died.
func (s *Service) brokerRedrive(ctx context.Context, cmd Command) (Result, error) {
	res := Result{Operation: cmd.Operation, DryRun: cmd.DryRun}
	if cmd.Source == SourceSubscriptionDLQ {
		return res, errors.New("dlq-redrive: source subscription-dlq exists only with SNS")
	}
	if cmd.DryRun {
		depths, err := s.cfg.Broker.Depths(ctx, cmd.Consumer)
		if err != nil || len(depths) != 1 {
			return res, fmt.Errorf("dlq-redrive: queue depths: %v", err)
		}
		res.Affected = min(depths[0].DLQ, int64(cmd.Max))
		res.Message = fmt.Sprintf("would move %d of %d messages from the DLQ of %s", res.Affected, depths[0].DLQ, cmd.Consumer)
		return res, nil
	}
	auditID, err := s.auditStart(ctx, s.db, cmd)
	if err != nil {
		return res, err
	}
	res.AuditID = auditID
	moved, opErr := s.cfg.Broker.Redrive(ctx, cmd.Consumer, cmd.Max)
	res.Affected = int64(moved)
	if err := s.auditFinish(ctx, auditID, cmd, int64(moved), opErr); err != nil && opErr == nil {
		opErr = err
	}
	if opErr != nil {
		return res, fmt.Errorf("dlq-redrive: after %d messages: %w", moved, opErr)
	}
	res.Message = fmt.Sprintf("moved %d messages from the DLQ of %s back to its queue", moved, cmd.Consumer)
	return res, nil
}
