package sns

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sqstypes "github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/fifobox/fifobox/pkg/transport"
)

// scanVisibility is how long a look at a dead-letter queue keeps the
// messages it received in flight at most; they are made visible again as
// soon as it ends (keptMessages.release), this only bounds a crash.
const scanVisibility = 120

// keptMessages are messages received from a queue and not deleted: they
// are made visible again, in place, when an operation ends.
type keptMessages struct {
	handles []string
	seen    map[string]bool // message ids, to notice one received twice
}

func (k *keptMessages) add(m sqstypes.Message) {
	if k.seen == nil {
		k.seen = map[string]bool{}
	}
	k.seen[aws.ToString(m.MessageId)] = true
	k.handles = append(k.handles, aws.ToString(m.ReceiptHandle))
}

// release makes the kept messages visible again (a visibility timeout of
// 0; ReceiveMessage cannot ask for 0 through the SDK), also when ctx has
// ended: nothing a look or a selective operation received stays in flight.
func (k *keptMessages) release(ctx context.Context, api SQSAPI, url string) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	for start := 0; start < len(k.handles); start += 10 {
		chunk := k.handles[start:min(start+10, len(k.handles))]
		entries := make([]sqstypes.ChangeMessageVisibilityBatchRequestEntry, len(chunk))
		for i, h := range chunk {
			entries[i] = sqstypes.ChangeMessageVisibilityBatchRequestEntry{Id: aws.String("k" + strconv.Itoa(i)),
				ReceiptHandle: aws.String(h), VisibilityTimeout: 0}
		}
		// Best effort: a message not released comes back after scanVisibility.
		_, _ = api.ChangeMessageVisibilityBatch(rctx, &sqs.ChangeMessageVisibilityBatchInput{QueueUrl: aws.String(url), Entries: entries})
	}
	k.handles = nil
}

// scan receives url's messages in order and calls visit for each; a
// message visit takes is deleted at once (which lets SQS hand out the next
// message of its group), every other one stays in flight until scan ends
// and is then made visible again in place. visit's stop ends the scan.
// With limit > 0 at most limit messages are visited. complete is false when
// the limit or a stop ended the scan early.
//
// An SQS FIFO queue hands out a group's next message only once the one
// before it is deleted or visible again, so a scan that keeps a group's
// first message never sees the rest of that group (AWS may return several
// of a group in one receive; the emulator returns one).
func (o *Operations) scan(ctx context.Context, url string, limit int, visit func(m sqstypes.Message) (take, stop bool)) (complete bool, err error) {
	var kept keptMessages
	defer kept.release(ctx, o.t.cfg.SQS, url)
	visited, empties := 0, 0
	for empties < 2 {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		out, err := o.t.cfg.SQS.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
			QueueUrl:            aws.String(url),
			MaxNumberOfMessages: 10,
			WaitTimeSeconds:     min(1, int32(empties)),
			VisibilityTimeout:   scanVisibility,
			MessageSystemAttributeNames: []sqstypes.MessageSystemAttributeName{sqstypes.MessageSystemAttributeNameMessageGroupId,
				sqstypes.MessageSystemAttributeNameSentTimestamp, sqstypes.MessageSystemAttributeNameApproximateReceiveCount},
			MessageAttributeNames: []string{"All"},
		})
		if err != nil {
			return false, fmt.Errorf("receive from %s: %w", url, sqsError(err))
		}
		var dels []sqstypes.DeleteMessageBatchRequestEntry
		fresh := 0
		stopped := false
		for _, m := range out.Messages {
			if kept.seen[aws.ToString(m.MessageId)] || stopped || (limit > 0 && visited >= limit) {
				// Seen before (its visibility ran out during a long scan), or past the end.
				kept.add(m)
				stopped = stopped || (limit > 0 && visited >= limit)
				continue
			}
			fresh++
			visited++
			take, stop := visit(m)
			if take {
				dels = append(dels, sqstypes.DeleteMessageBatchRequestEntry{Id: aws.String("d" + strconv.Itoa(len(dels))), ReceiptHandle: m.ReceiptHandle})
			} else {
				kept.add(m)
			}
			stopped = stopped || stop
		}
		if len(dels) > 0 {
			dout, err := o.t.cfg.SQS.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: dels})
			if err != nil {
				return false, fmt.Errorf("delete from %s: %w", url, sqsError(err))
			}
			if len(dout.Failed) > 0 {
				return false, fmt.Errorf("delete from %s: %d of %d entries failed: %s", url, len(dout.Failed), len(dels), aws.ToString(dout.Failed[0].Message))
			}
		}
		if stopped {
			return false, nil
		}
		if fresh == 0 {
			empties++
		} else {
			empties = 0
		}
	}
	return true, nil
}

// describe is m as an operator sees it.
func (o *Operations) describe(m sqstypes.Message, fromSubscription, body bool) transport.DLQMessage {
	d := transport.DLQMessage{ID: aws.ToString(m.MessageId), Group: m.Attributes[string(sqstypes.MessageSystemAttributeNameMessageGroupId)]}
	b, _ := redriven(m, fromSubscription)
	d.Describe([]byte(b))
	if v, ok := m.MessageAttributes[AttrErrorClass]; ok {
		d.ErrorClass = aws.ToString(v.StringValue)
	}
	if v, ok := m.MessageAttributes[AttrErrorReason]; ok {
		d.ErrorReason = aws.ToString(v.StringValue)
	}
	if fromSubscription {
		if v, ok := m.MessageAttributes["ErrorMessage"]; ok {
			d.ErrorClass, d.ErrorReason = "undeliverable", aws.ToString(v.StringValue)
		}
	}
	if ms, err := strconv.ParseInt(m.Attributes[string(sqstypes.MessageSystemAttributeNameSentTimestamp)], 10, 64); err == nil {
		t := time.UnixMilli(ms).UTC()
		d.DeadAt = &t
	}
	if body {
		d.Body = b
	}
	return d
}

// Peek lists the dead-letter queue's messages (transport.Operations.Peek):
// it receives them and makes every one visible again at the end, so
// nothing stays in flight and each group keeps its order. SQS shows a FIFO
// group's messages in order only, one receive at a time: a message behind
// its group's first is seen only if SQS hands both out in one receive
// (AWS may; the emulator does not). Complete says whether every message
// of the queue was seen.
func (o *Operations) Peek(ctx context.Context, req transport.PeekRequest) (transport.PeekResult, error) {
	res := transport.PeekResult{Total: -1}
	if err := req.Validate(); err != nil {
		return res, err
	}
	if req.Limit < 1 {
		return res, fmt.Errorf("peek: limit must be at least 1")
	}
	_, source, _, err := o.source(ctx, req.Consumer, req.From)
	if err != nil {
		return res, err
	}
	if visible, inFlight, err := o.queueDepth(ctx, source); err != nil {
		return res, sqsError(err)
	} else {
		res.Total = visible + inFlight
	}
	seen := 0
	full := false
	complete, err := o.scan(ctx, source, 0, func(m sqstypes.Message) (bool, bool) {
		seen++
		d := o.describe(m, req.From == transport.SubscriptionDLQ, req.Bodies)
		if req.Matches(d) {
			res.Messages = append(res.Messages, d)
		}
		full = len(res.Messages) >= req.Limit
		return false, full
	})
	res.Complete = complete && !full && int64(seen) >= res.Total
	return res, err
}

// Discard deletes the selected messages from the dead-letter queue
// (transport.Operations.Discard). It receives the queue's messages in
// order, deletes each selected one at once (which lets SQS hand out the
// next message of its group: a whole group is deleted message by message)
// and makes every other message visible again at the end, in place. A
// requested key behind a message that stays in its group (the group's
// first message is not selected) cannot be reached: it is Missing. A dry
// run deletes nothing, so it sees at most each group's first messages.
func (o *Operations) Discard(ctx context.Context, req transport.DiscardRequest) (transport.DiscardResult, error) {
	var res transport.DiscardResult
	if err := req.Validate(); err != nil {
		return res, err
	}
	if req.All() {
		return res, fmt.Errorf("discard: select messages by group or key")
	}
	if req.Max < 1 {
		return res, fmt.Errorf("discard: max must be at least 1")
	}
	_, source, _, err := o.source(ctx, req.Consumer, req.From)
	if err != nil {
		return res, err
	}
	total := int64(-1)
	if visible, _, err := o.queueDepth(ctx, source); err == nil {
		total = visible
	}
	seen := int64(0)
	found := map[string]bool{}
	complete, err := o.scan(ctx, source, 0, func(m sqstypes.Message) (bool, bool) {
		seen++
		d := o.describe(m, req.From == transport.SubscriptionDLQ, false)
		take := req.Matches(d) && len(res.Discarded) < req.Max
		if take {
			res.Discarded = append(res.Discarded, d)
			found[d.Key], found[d.ID] = true, true
		}
		if req.Progress != nil {
			req.Progress(seen, max(total, seen))
		}
		return take && !req.DryRun, len(res.Discarded) >= req.Max || (len(req.Groups)+len(req.Aggregates) == 0 && allFound(req.Keys, found))
	})
	for _, k := range req.Keys {
		if !found[k] {
			res.Missing = append(res.Missing, k)
		}
	}
	res.Complete = complete && (!req.DryRun || seen >= total)
	return res, err
}

func allFound(keys []string, found map[string]bool) bool {
	return !slices.ContainsFunc(keys, func(k string) bool { return !found[k] })
}
