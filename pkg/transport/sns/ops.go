package sns

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"
	"github.com/aws/smithy-go"
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
// FIFOBOX_QUEUES, else the topology's. A queue that cannot be read gets its
// state (missing, unreachable, error), -1 figures and the consumer's Error,
// and leaves the rest of the report intact; once SQS proved unreachable the
// remaining consumers are reported so without waiting out the SDK's
// retries again.
func (o *Operations) Depths(ctx context.Context, consumers ...string) ([]transport.QueueDepth, error) {
	names := consumers
	if len(names) == 0 {
		names = o.t.consumerNames()
	}
	out := make([]transport.QueueDepth, 0, len(names))
	var down error
	for _, name := range names {
		if down != nil {
			d := unknownDepth(name)
			d.QueueState, d.DLQState, d.SubscriptionDLQState = transport.StateUnreachable, transport.StateUnreachable, transport.StateUnreachable
			d.Error = down.Error() // the same SQS, not asked again
			out = append(out, d)
			continue
		}
		d, err := o.depth(ctx, name)
		if err != nil && transport.Unreachable(err) {
			down = err
		}
		out = append(out, d)
	}
	return out, nil
}

func unknownDepth(name string) transport.QueueDepth {
	return transport.QueueDepth{Consumer: name, Consumers: -1, Ready: -1, InFlight: -1, DLQ: -1, DLQInFlight: -1, SubscriptionDLQ: -1}
}

// known reports whether the transport can locate consumer's queues: it is
// in FIFOBOX_QUEUES when that is set, else in the topology.
func (o *Operations) known(consumer string) error {
	if len(o.t.cfg.Queues) > 0 {
		if _, ok := o.t.cfg.Queues[consumer]; !ok {
			return fmt.Errorf("consumer %q has no queues in %s (known: %s)", consumer, EnvQueues, strings.Join(o.t.cfg.Queues.Names(), ", "))
		}
		return nil
	}
	if _, ok := o.t.cfg.Topology.Consumer(consumer); !ok {
		var names []string
		for _, c := range o.t.cfg.Topology.Consumers {
			names = append(names, c.Name)
		}
		return fmt.Errorf("consumer %q is not in the topology (known: %s)", consumer, strings.Join(names, ", "))
	}
	return nil
}

// depth reads one consumer's figures; err is the first failure (also in
// the depth's Error), for Depths to tell an unreachable SQS.
func (o *Operations) depth(ctx context.Context, name string) (transport.QueueDepth, error) {
	d := unknownDepth(name)
	fail := func(state transport.QueueState, err error) (transport.QueueDepth, error) {
		d.QueueState, d.DLQState, d.SubscriptionDLQState = state, state, state
		d.Error = err.Error()
		return d, err
	}
	if err := o.known(name); err != nil {
		return fail(transport.StateMissing, err)
	}
	q, err := o.t.queues(ctx, name)
	if err != nil {
		err = sqsError(err)
		return fail(sqsState(err), err)
	}
	d.Queue = q.QueueURL[strings.LastIndex(q.QueueURL, "/")+1:]
	var errs []string
	read := func(what, url string, visible, inFlight *int64, state *transport.QueueState) {
		v, f, err := o.queueDepth(ctx, url)
		if err != nil {
			err = sqsError(err)
			*state = sqsState(err)
			errs = append(errs, what+" "+url+": "+err.Error())
			return
		}
		*visible, *state = v, transport.StateOK
		if inFlight != nil {
			*inFlight = f
		}
	}
	read("queue", q.QueueURL, &d.Ready, &d.InFlight, &d.QueueState)
	if d.QueueState == transport.StateUnreachable {
		d.DLQState, d.SubscriptionDLQState = transport.StateUnreachable, transport.StateUnreachable
		d.Error = strings.Join(errs, "; ")
		return d, errors.New(d.Error)
	}
	read("dlq", q.DLQURL, &d.DLQ, &d.DLQInFlight, &d.DLQState)
	if q.SubscriptionDLQURL != "" {
		read("subscription dlq", q.SubscriptionDLQURL, &d.SubscriptionDLQ, nil, &d.SubscriptionDLQState)
	} else {
		d.SubscriptionDLQ, d.SubscriptionDLQState = 0, transport.StateNone
	}
	if len(errs) > 0 {
		d.Error = strings.Join(errs, "; ")
		return d, errors.New(d.Error)
	}
	return d, nil
}

// sqsNotFound are the error codes SQS (and the emulators) answer for a
// queue that does not exist.
var sqsNotFound = map[string]bool{"AWS.SimpleQueueService.NonExistentQueue": true, "QueueDoesNotExist": true, "NonExistentQueue": true}

// sqsState classifies an SQS error.
func sqsState(err error) transport.QueueState {
	var nf *sqstypes.QueueDoesNotExist
	var api smithy.APIError
	switch {
	case err == nil:
		return transport.StateOK
	case errors.As(err, &nf), errors.As(err, &api) && sqsNotFound[api.ErrorCode()]:
		return transport.StateMissing
	case transport.Unreachable(err):
		return transport.StateUnreachable
	}
	return transport.StateError
}

// sqsError names the endpoint of an SQS call that could not reach it (the
// SDK's own message buries it after its retries).
func sqsError(err error) error {
	var u *url.Error
	if transport.Unreachable(err) && errors.As(err, &u) {
		endpoint := u.URL
		if p, perr := url.Parse(u.URL); perr == nil {
			endpoint = p.Scheme + "://" + p.Host
		}
		return fmt.Errorf("SQS endpoint %s unreachable: %w", endpoint, u.Err)
	}
	return err
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
	q, source, from, err := o.source(ctx, req.Consumer, req.From)
	if err != nil {
		return res, err
	}
	fromSubscription := req.From == transport.SubscriptionDLQ
	sel := transport.DLQSelection{Groups: req.Groups, Aggregates: req.Aggregates}
	if visible, inFlight, err := o.queueDepth(ctx, source); err != nil {
		if req.DryRun {
			return res, sqsError(err)
		}
	} else {
		res.Waiting, res.InFlight = visible, inFlight
	}
	if req.DryRun && sel.All() {
		// Every visible message moves (those in flight only if they come
		// back while the redrive runs): exact when nothing is in flight.
		res.Moved = int(min(res.Waiting, int64(req.Max)))
		res.Complete = res.InFlight == 0
		return res, nil
	}
	if req.DryRun {
		seen, n := 0, 0
		complete, err := o.scan(ctx, source, 0, func(m sqstypes.Message) (bool, bool) {
			seen++
			if sel.Matches(o.describe(m, fromSubscription, false)) && n < req.Max {
				n++
			}
			return false, false
		})
		res.Moved, res.Complete = n, complete && int64(seen) >= res.Waiting
		return res, err
	}
	total := int64(-1)
	if res.Waiting >= 0 && sel.All() {
		total = min(res.Waiting, int64(req.Max))
	}
	run := uuid.NewString() // this redrive's deduplication ids
	// SQS's clock stamps SentTimestamp. Skew between it and ours is small;
	// its only effect is that a message dead-lettered again within that
	// skew is moved once more (harmless: the inbox and the holds keep
	// order and exactly-once).
	cutoff := time.Now()
	stopped := map[string]bool{} // groups whose next message is newer than the cutoff
	// Messages received and not moved (other groups, or dead-lettered
	// again during the redrive) stay in flight until the redrive ends, so
	// it does not receive them again; then they are made visible, in place.
	var kept keptMessages
	defer kept.release(ctx, o.t.cfg.SQS, source)
	empties := 0
	for res.Moved < req.Max && empties < 2 {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("stopped after %d messages: %w", res.Moved, err)
		}
		out, err := o.t.cfg.SQS.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
			QueueUrl:            aws.String(source),
			MaxNumberOfMessages: int32(min(sqsBatchSize, req.Max-res.Moved)),
			WaitTimeSeconds:     1,
			VisibilityTimeout:   scanVisibility,
			MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameMessageGroupId,
				sqstypes.MessageSystemAttributeNameSentTimestamp},
			MessageAttributeNames: []string{"All"},
		})
		if err != nil {
			return res, fmt.Errorf("receive from %s: %w", from, sqsError(err))
		}
		var entries []sqstypes.SendMessageBatchRequestEntry
		var dels []sqstypes.DeleteMessageBatchRequestEntry
		for i, m := range out.Messages {
			group := m.Attributes[string(sqstypes.MessageSystemAttributeNameMessageGroupId)]
			if group == "" {
				kept.add(m)
				return res, fmt.Errorf("message %s in %s has no MessageGroupId (is it a FIFO queue?)", aws.ToString(m.MessageId), from)
			}
			if !sel.All() && !sel.Matches(o.describe(m, fromSubscription, false)) {
				kept.add(m)
				continue
			}
			if stopped[group] || sentAfter(m, cutoff) {
				// Dead-lettered after the redrive started: it and the
				// rest of its group stay for the next redrive.
				stopped[group] = true
				res.Left++
				kept.add(m)
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
			// Nothing deleted: the messages are made visible again in the DLQ.
			for _, d := range dels {
				kept.handles = append(kept.handles, aws.ToString(d.ReceiptHandle))
			}
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

// source returns consumer's queues and the URL and description of the
// dead-letter queue from.
func (o *Operations) source(ctx context.Context, consumer string, from transport.DLQ) (q QueueURLs, url, what string, err error) {
	if err := o.known(consumer); err != nil {
		return q, "", "", err
	}
	q, err = o.t.queues(ctx, consumer)
	if err != nil {
		return q, "", "", sqsError(err)
	}
	switch from {
	case transport.SubscriptionDLQ:
		if q.SubscriptionDLQURL == "" {
			return q, "", "", fmt.Errorf("consumer %q has no subscription_dlq_url in %s", consumer, EnvQueues)
		}
		return q, q.SubscriptionDLQURL, "the subscription DLQ", nil
	case "", transport.ConsumerDLQ:
		return q, q.DLQURL, "the DLQ", nil
	}
	return q, "", "", fmt.Errorf("redrive: %s: %w", from, transport.ErrNoSuchDLQ)
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
