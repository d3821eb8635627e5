package sns

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
	"github.com/google/uuid"

	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// sqsBatchSize is how many messages one SendMessageBatch carries: SQS
// allows 10, and some emulators reorder a 10-entry batch.
const sqsBatchSize = 9

// Operations are the SQS side of the operator's actions (transport.Operations):
// queue depths, DLQ and subscription-DLQ redrive by receive-and-resend
// (works on AWS, LocalStack and emulators without StartMessageMoveTask),
// and replay sends to one consumer's queue.
type Operations struct {
	t *Transport
}

var _ transport.Operations = (*Operations)(nil)

// Depths reports each consumer's approximate queue, DLQ and subscription
// DLQ depths (SQS GetQueueAttributes). Consumers default to those of
// FIFOBOX_QUEUES, else the topology's. A queue that cannot be read sets
// the consumer's Error and leaves the rest of the report intact.
func (o *Operations) Depths(ctx context.Context, consumers ...string) ([]transport.QueueDepth, error) {
	names := consumers
	if len(names) == 0 {
		names = o.t.consumerNames()
	}
	out := make([]transport.QueueDepth, 0, len(names))
	for _, name := range names {
		out = append(out, o.depth(ctx, name))
	}
	return out, nil
}

func (o *Operations) depth(ctx context.Context, name string) transport.QueueDepth {
	d := transport.QueueDepth{Consumer: name, Consumers: -1}
	q, err := o.t.queues(ctx, name)
	if err != nil {
		d.Error = err.Error()
		return d
	}
	d.Queue = q.QueueURL[strings.LastIndex(q.QueueURL, "/")+1:]
	if d.Ready, d.InFlight, err = o.queueDepth(ctx, q.QueueURL); err != nil {
		d.Error = "queue: " + err.Error()
		return d
	}
	if d.DLQ, d.DLQInFlight, err = o.queueDepth(ctx, q.DLQURL); err != nil {
		d.Error = "dlq: " + err.Error()
		return d
	}
	if q.SubscriptionDLQURL != "" {
		if d.SubscriptionDLQ, _, err = o.queueDepth(ctx, q.SubscriptionDLQURL); err != nil {
			d.Error = "subscription dlq: " + err.Error()
		}
	}
	return d
}

func (o *Operations) queueDepth(ctx context.Context, url string) (visible, inFlight int64, err error) {
	out, err := o.t.cfg.SQS.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: aws.String(url),
		AttributeNames: []sqstypes.QueueAttributeName{sqstypes.QueueAttributeNameApproximateNumberOfMessages,
			sqstypes.QueueAttributeNameApproximateNumberOfMessagesNotVisible}})
	if err != nil {
		return 0, 0, err
	}
	visible, _ = strconv.ParseInt(out.Attributes[string(sqstypes.QueueAttributeNameApproximateNumberOfMessages)], 10, 64)
	inFlight, _ = strconv.ParseInt(out.Attributes[string(sqstypes.QueueAttributeNameApproximateNumberOfMessagesNotVisible)], 10, 64)
	return visible, inFlight, nil
}

// snsErrorAttributes are what SNS adds to a message it dead-letters from a
// subscription; they describe the failed delivery, not the event.
var snsErrorAttributes = map[string]bool{"ErrorCode": true, "ErrorMessage": true, "RequestID": true}

// Redrive moves up to Max messages from the consumer's DLQ (or its SNS
// subscription's DLQ) back to its queue: receive a batch (one group's
// messages arrive in order, and the group stays locked while they are in
// flight), send them to the queue in the same order with the same
// MessageGroupId, body and attributes (minus the fifobox_error_* and SNS
// delivery-error diagnostics) and a deduplication id of this redrive's own,
// then delete them from the DLQ. A crash between send and delete re-sends
// on the next run: the consumer's inbox drops the duplicate.
//
// Only messages that were in the DLQ when the redrive started move: a
// message dead-lettered again meanwhile (still failing, or held behind one
// that is) stays for the next redrive, with its group's later messages, so
// a redrive ends instead of cycling messages between the queues.
//
// A subscription DLQ holds what SNS could not deliver. With raw delivery
// its messages are the published ones; a body in SNS's notification JSON
// is unwrapped to the published message and attributes.
func (o *Operations) Redrive(ctx context.Context, req transport.RedriveRequest) (transport.RedriveResult, error) {
	res := transport.RedriveResult{Waiting: -1, InFlight: -1}
	if req.Max < 1 {
		return res, errors.New("redrive: max must be at least 1")
	}
	q, err := o.t.queues(ctx, req.Consumer)
	if err != nil {
		return res, err
	}
	source, from := q.DLQURL, "the DLQ"
	fromSubscription := req.From == transport.SubscriptionDLQ
	switch {
	case fromSubscription && q.SubscriptionDLQURL == "":
		return res, fmt.Errorf("consumer %q has no subscription_dlq_url in %s", req.Consumer, EnvQueues)
	case fromSubscription:
		source, from = q.SubscriptionDLQURL, "the subscription DLQ"
	case req.From != "" && req.From != transport.ConsumerDLQ:
		return res, fmt.Errorf("redrive: %s: %w", req.From, transport.ErrNoSuchDLQ)
	}
	if visible, inFlight, err := o.queueDepth(ctx, source); err != nil {
		if req.DryRun {
			return res, err
		}
	} else {
		res.Waiting, res.InFlight = visible, inFlight
	}
	if req.DryRun {
		res.Moved = int(min(res.Waiting, int64(req.Max)))
		return res, nil
	}
	total := int64(-1)
	if res.Waiting >= 0 {
		total = min(res.Waiting, int64(req.Max))
	}
	run := uuid.NewString() // this redrive's deduplication ids
	// SQS's clock stamps SentTimestamp. Skew between it and ours is small;
	// its only effect is that a message dead-lettered again within that
	// skew is moved once more (harmless: the inbox and the holds keep
	// order and exactly-once).
	cutoff := time.Now()
	stopped := map[string]bool{} // groups whose next message is newer than the cutoff
	empties := 0
	for res.Moved < req.Max && empties < 2 {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("stopped after %d messages: %w", res.Moved, err)
		}
		out, err := o.t.cfg.SQS.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
			QueueUrl:            aws.String(source),
			MaxNumberOfMessages: int32(min(sqsBatchSize, req.Max-res.Moved)),
			WaitTimeSeconds:     1,
			VisibilityTimeout:   60,
			MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameMessageGroupId,
				sqstypes.MessageSystemAttributeNameSentTimestamp},
			MessageAttributeNames: []string{"All"},
		})
		if err != nil {
			return res, fmt.Errorf("receive from %s: %w", from, err)
		}
		var entries []sqstypes.SendMessageBatchRequestEntry
		var dels []sqstypes.DeleteMessageBatchRequestEntry
		for i, m := range out.Messages {
			group := m.Attributes[string(sqstypes.MessageSystemAttributeNameMessageGroupId)]
			if group == "" {
				return res, fmt.Errorf("message %s in %s has no MessageGroupId (is it a FIFO queue?)", aws.ToString(m.MessageId), from)
			}
			if stopped[group] || sentAfter(m, cutoff) {
				// Dead-lettered after the redrive started: it and the
				// rest of its group stay (invisible for the receive's
				// visibility timeout, so this run does not see them again).
				stopped[group] = true
				res.Left++
				continue
			}
			body, attrs := redriven(m, fromSubscription)
			id := "m" + strconv.Itoa(i)
			entries = append(entries, sqstypes.SendMessageBatchRequestEntry{
				Id:                     aws.String(id),
				MessageBody:            aws.String(body),
				MessageGroupId:         aws.String(group),
				MessageDeduplicationId: aws.String("redrive-" + run + "-" + aws.ToString(m.MessageId)),
				MessageAttributes:      attrs,
			})
			dels = append(dels, sqstypes.DeleteMessageBatchRequestEntry{Id: aws.String(id), ReceiptHandle: m.ReceiptHandle})
		}
		if len(entries) == 0 {
			empties++
			continue
		}
		empties = 0
		if err := o.sendBatch(ctx, q.QueueURL, entries); err != nil {
			// Nothing deleted: the messages reappear in the DLQ after the visibility timeout.
			return res, err
		}
		dout, err := o.t.cfg.SQS.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(source), Entries: dels})
		if err != nil {
			return res, fmt.Errorf("delete from %s (messages were re-sent; the inbox drops duplicates): %w", from, err)
		}
		if len(dout.Failed) > 0 {
			return res, fmt.Errorf("delete from %s: %d entries failed (re-sent; the inbox drops duplicates)", from, len(dout.Failed))
		}
		res.Moved += len(entries)
		if req.Progress != nil {
			req.Progress(int64(res.Moved), total)
		}
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

// Replay sends msgs to the consumer's queue only, in the order given, in
// batches of SendMessageBatch: MessageGroupId = aggregate id, the stored
// body, the SNS message attributes, and a deduplication id of this call's
// own (the original event id may still be in the queue's 5-minute
// deduplication window). Any failed entry stops the replay (the entries
// after it in the same group must not overtake it); it returns how many
// were sent before.
func (o *Operations) Replay(ctx context.Context, consumer string, msgs []outbox.Message) (int, error) {
	q, err := o.t.queues(ctx, consumer)
	if err != nil {
		return 0, fmt.Errorf("replay: %w", err)
	}
	run := uuid.NewString()
	sent := 0
	for start := 0; start < len(msgs); start += sqsBatchSize {
		chunk := msgs[start:min(start+sqsBatchSize, len(msgs))]
		entries := make([]sqstypes.SendMessageBatchRequestEntry, len(chunk))
		for i, m := range chunk {
			attrs := map[string]sqstypes.MessageAttributeValue{}
			for k, v := range m.Attributes {
				attrs[k] = sqstypes.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
			}
			entries[i] = sqstypes.SendMessageBatchRequestEntry{
				Id:                     aws.String(fmt.Sprintf("e%d", i)),
				MessageBody:            aws.String(string(m.Body)),
				MessageGroupId:         aws.String(m.GroupID),
				MessageDeduplicationId: aws.String("replay-" + run + "-" + m.EventID),
				MessageAttributes:      attrs,
			}
		}
		if err := o.sendBatch(ctx, q.QueueURL, entries); err != nil {
			return sent, err
		}
		sent += len(chunk)
	}
	return sent, nil
}

// Selects reports whether the consumer's subscription filter policy
// selects m (a consumer the topology does not know takes every event).
func (o *Operations) Selects(consumer string, m outbox.Message) (bool, error) {
	c, ok := o.t.cfg.Topology.Consumer(consumer)
	if !ok {
		return true, nil
	}
	return c.Matches(m.Attributes), nil
}

func (o *Operations) sendBatch(ctx context.Context, queueURL string, entries []sqstypes.SendMessageBatchRequestEntry) error {
	out, err := o.t.cfg.SQS.SendMessageBatch(ctx, &sqs.SendMessageBatchInput{QueueUrl: aws.String(queueURL), Entries: entries})
	if err != nil {
		return fmt.Errorf("send message batch: %w", err)
	}
	if len(out.Failed) > 0 {
		var msgs []string
		for _, f := range out.Failed {
			msgs = append(msgs, aws.ToString(f.Id)+": "+aws.ToString(f.Code)+" "+aws.ToString(f.Message))
		}
		return fmt.Errorf("send message batch: %d of %d entries failed: %s", len(out.Failed), len(entries), strings.Join(msgs, "; "))
	}
	return nil
}
