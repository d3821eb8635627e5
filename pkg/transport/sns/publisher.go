package sns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"

	"github.com/aws/aws-sdk-go-v2/aws"
	snssvc "github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sns/types"
	"github.com/aws/smithy-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/wire"
)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// TopicARN of the SNS FIFO topic. Required.
	TopicARN string
	// MaxEntries per PublishBatch call. Default 10, the SNS limit.
	MaxEntries int
	// MaxBatchBytes per PublishBatch call, bodies plus attributes. Default 262,144, the SNS limit.
	MaxBatchBytes int
	// Wire, if set, publishes every event as this wire profile renders it
	// (body, message attributes, group and deduplication ids) instead of
	// fifobox's envelope (pkg/wire).
	Wire *wire.Mapper
	// Topology, if set, is what the topic's subscriptions select: an event
	// no subscription's filter accepts is published (SNS takes it and
	// delivers it nowhere) and reported as unrouted, the way the broker
	// transports report theirs (transport.UnroutedDeliver).
	Topology *topology.Topology
	// Logger for the unrouted-event lines; default slog.Default().
	Logger *slog.Logger
}

func (c *PublisherConfig) setDefaults() {
	if c.MaxEntries == 0 {
		c.MaxEntries = 10
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.MaxBatchBytes == 0 {
		c.MaxBatchBytes = envelope.DefaultMaxMessageBytes
	}
}

// Validate reports the first invalid field.
func (c PublisherConfig) Validate() error {
	switch {
	case c.TopicARN == "":
		return errors.New("TopicARN: required")
	case c.MaxEntries < 1 || c.MaxEntries > 10:
		return fmt.Errorf("MaxEntries %d: must be 1-10", c.MaxEntries)
	case c.MaxBatchBytes < 1024 || c.MaxBatchBytes > envelope.DefaultMaxMessageBytes:
		return fmt.Errorf("MaxBatchBytes %d: must be 1024-%d", c.MaxBatchBytes, envelope.DefaultMaxMessageBytes)
	}
	return nil
}

// Publisher is the outbox.Publisher for an SNS FIFO topic. It sends
// PublishBatch calls of at most 10 entries and 262,144 bytes, with
// MessageGroupId = aggregate id and MessageDeduplicationId = event id, and
// maps every entry's result to nil (published), a retryable error
// (throttling, 5xx, network) or envelope.Permanent (the request itself is
// invalid, so no retry can succeed).
type Publisher struct {
	api SNSAPI
	cfg PublisherConfig
}

// NewPublisher returns a Publisher.
func NewPublisher(api SNSAPI, cfg PublisherConfig) (*Publisher, error) {
	if api == nil {
		return nil, errors.New("new sns publisher: api is nil")
	}
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("new sns publisher: %w", err)
	}
	return &Publisher{api: api, cfg: cfg}, nil
}

var _ outbox.Publisher = (*Publisher)(nil)

// ErrPredecessorFailed is returned for a message whose earlier message of the
// same group in the same Publish call was not published: sending it would
// break the group's order.
var ErrPredecessorFailed = errors.New("sns publisher: an earlier message of the same group was not published")

// Publish implements outbox.Publisher. Messages of one group are published
// strictly in the given order, each only after the previous one succeeded
// (the dispatcher never passes two, but the publisher does not rely on it).
func (p *Publisher) Publish(ctx context.Context, msgs []outbox.Message) []error {
	errs := make([]error, len(msgs))
	if p.cfg.Wire != nil {
		msgs = p.render(msgs, errs)
	}
	// Waves: the k-th message of each group goes in wave k.
	seen := map[string]int{}
	var waves [][]int
	for i, m := range msgs {
		k := seen[m.GroupID]
		seen[m.GroupID] = k + 1
		if k == len(waves) {
			waves = append(waves, nil)
		}
		waves[k] = append(waves[k], i)
	}
	failedGroup := map[string]bool{}
	for _, wave := range waves {
		var send []int
		for _, i := range wave {
			if errs[i] != nil {
				continue
			}
			if failedGroup[msgs[i].GroupID] {
				errs[i] = ErrPredecessorFailed
				continue
			}
			send = append(send, i)
		}
		for _, batch := range p.split(msgs, send) {
			p.publishBatch(ctx, msgs, batch, errs)
		}
		for _, i := range wave {
			if errs[i] != nil {
				failedGroup[msgs[i].GroupID] = true
			}
		}
	}
	if p.cfg.Topology != nil {
		for i := range msgs {
			if errs[i] == nil && p.cfg.Topology.Unselected(msgs[i].Attributes) {
				transport.LogUnrouted(p.cfg.Logger, transport.SNS, transport.UnroutedDeliver, &msgs[i], "nowhere (no subscription's filter accepts it)")
			}
		}
	}
	return errs
}

// split groups indexes into calls within the entry and byte limits.
func (p *Publisher) split(msgs []outbox.Message, idx []int) [][]int {
	var out [][]int
	var cur []int
	size := 0
	for _, i := range idx {
		n := len(msgs[i].Body) + envelope.AttributesSize(msgs[i].Attributes)
		if len(cur) > 0 && (len(cur) == p.cfg.MaxEntries || size+n > p.cfg.MaxBatchBytes) {
			out = append(out, cur)
			cur, size = nil, 0
		}
		cur = append(cur, i)
		size += n
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out
}

func (p *Publisher) publishBatch(ctx context.Context, msgs []outbox.Message, idx []int, errs []error) {
	entries := make([]types.PublishBatchRequestEntry, len(idx))
	for k, i := range idx {
		m := msgs[i]
		attrs := make(map[string]types.MessageAttributeValue, len(m.Attributes))
		for name, v := range m.Attributes {
			attrs[name] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
		}
		entries[k] = types.PublishBatchRequestEntry{
			Id:                     aws.String(strconv.Itoa(k)),
			Message:                aws.String(string(m.Body)),
			MessageGroupId:         aws.String(m.GroupID),
			MessageDeduplicationId: aws.String(m.EventID),
			MessageAttributes:      attrs,
		}
	}
	out, err := p.api.PublishBatch(ctx, &snssvc.PublishBatchInput{TopicArn: aws.String(p.cfg.TopicARN), PublishBatchRequestEntries: entries})
	if err != nil {
		err = classify(err)
		if envelope.IsPermanent(err) && len(idx) > 1 {
			// One bad entry can fail a whole call: isolate it so the others
			// are not declared dead with it.
			for _, i := range idx {
				p.publishBatch(ctx, msgs, []int{i}, errs)
			}
			return
		}
		for _, i := range idx {
			errs[i] = fmt.Errorf("sns publish batch: %w", err)
		}
		return
	}
	done := make([]bool, len(idx))
	for _, s := range out.Successful {
		if k, ok := entryIndex(s.Id, len(idx)); ok {
			done[k] = true
		}
	}
	for _, f := range out.Failed {
		k, ok := entryIndex(f.Id, len(idx))
		if !ok {
			continue
		}
		done[k] = true
		e := fmt.Errorf("sns publish entry: %s: %s", aws.ToString(f.Code), aws.ToString(f.Message))
		if f.SenderFault && permanentCode(aws.ToString(f.Code)) {
			e = envelope.Permanent(e)
		}
		errs[idx[k]] = e
	}
	for k, ok := range done {
		if !ok {
			errs[idx[k]] = errors.New("sns publish entry: no result returned for entry")
		}
	}
}

func entryIndex(id *string, n int) (int, bool) {
	k, err := strconv.Atoi(aws.ToString(id))
	return k, err == nil && k >= 0 && k < n
}

// classify marks errors no retry can fix as permanent; everything else
// (throttling, 5xx, network, timeouts, unknown) stays retryable, because
// retrying is always safe and giving up parks an aggregate. Per-entry
// results follow the same rule: a sender fault is permanent only with a
// code known to be (permanentCode); an unknown code is retried, and goes
// dead only when the dispatcher's retry budget (RetryFor) runs out.
func classify(err error) error {
	var apiErr smithy.APIError
	if errors.As(err, &apiErr) {
		if apiErr.ErrorFault() == smithy.FaultClient && permanentCode(apiErr.ErrorCode()) {
			return envelope.Permanent(err)
		}
	}
	return err
}

func permanentCode(code string) bool {
	switch code {
	case "InvalidParameter", "InvalidParameterValue", "InvalidParameterException",
		"ValidationError", "ValidationException", "BatchEntryIdsNotDistinct",
		"BatchRequestTooLong", "TooManyEntriesInBatchRequest", "EmptyBatchRequest",
		"InvalidBatchEntryId", "InvalidMessage":
		return true
	}
	return false
}
