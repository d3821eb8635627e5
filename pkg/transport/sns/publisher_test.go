package sns_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	snssvc "github.com/aws/aws-sdk-go-v2/service/sns"
	"github.com/aws/aws-sdk-go-v2/service/sns/types"
	"github.com/aws/smithy-go"

	"github.com/fifobox/fifobox/pkg/envelope"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/topology"
	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// fakeSNS records calls and answers per entry through a callback.
type fakeSNS struct {
	sns.SNSAPI // only PublishBatch is called; the rest panics
	mu         sync.Mutex
	calls      [][]types.PublishBatchRequestEntry
	// entry decides an entry's fate: nil = success, else a failure.
	entry func(e types.PublishBatchRequestEntry) *types.BatchResultErrorEntry
	// call, if set, fails the whole call.
	call func(entries []types.PublishBatchRequestEntry) error
}

func (f *fakeSNS) PublishBatch(ctx context.Context, in *snssvc.PublishBatchInput, _ ...func(*snssvc.Options)) (*snssvc.PublishBatchOutput, error) {
	f.mu.Lock()
	f.calls = append(f.calls, in.PublishBatchRequestEntries)
	f.mu.Unlock()
	if f.call != nil {
		if err := f.call(in.PublishBatchRequestEntries); err != nil {
			return nil, err
		}
	}
	out := &snssvc.PublishBatchOutput{}
	for _, e := range in.PublishBatchRequestEntries {
		if f.entry != nil {
			if fail := f.entry(e); fail != nil {
				fail.Id = e.Id
				out.Failed = append(out.Failed, *fail)
				continue
			}
		}
		out.Successful = append(out.Successful, types.PublishBatchResultEntry{Id: e.Id, MessageId: aws.String("m-" + aws.ToString(e.Id))})
	}
	return out, nil
}

func msg(group string, seq int64, bodySize int) outbox.Message {
	return outbox.Message{
		EventID: fmt.Sprintf("00000000-0000-7000-8000-%012d", seq),
		GroupID: group, Sequence: seq, Body: []byte(strings.Repeat("b", bodySize)),
		Attributes: map[string]string{"event_type": "order.created", "aggregate_type": "order"},
	}
}

func TestSplitsByEntriesAndBytes(t *testing.T) {
	t.Parallel()
	f := &fakeSNS{}
	p, err := sns.NewPublisher(f, sns.PublisherConfig{TopicARN: "arn:aws:sns:us-east-1:000000000000:t.fifo"})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []outbox.Message
	for i := 0; i < 23; i++ {
		msgs = append(msgs, msg(fmt.Sprintf("g%d", i), int64(i+1), 100))
	}
	for _, e := range p.Publish(context.Background(), msgs) {
		if e != nil {
			t.Fatal(e)
		}
	}
	if len(f.calls) != 3 || len(f.calls[0]) != 10 || len(f.calls[2]) != 3 {
		t.Fatalf("calls of %v entries, want 10,10,3", lens(f.calls))
	}
	// Four 100 KB messages: at most two fit under 256 KiB per call.
	f.calls = nil
	big := []outbox.Message{msg("a", 1, 100_000), msg("b", 2, 100_000), msg("c", 3, 100_000), msg("d", 4, 100_000)}
	for _, e := range p.Publish(context.Background(), big) {
		if e != nil {
			t.Fatal(e)
		}
	}
	if got := lens(f.calls); len(got) != 2 || got[0] != 2 || got[1] != 2 {
		t.Fatalf("calls of %v entries, want 2,2", got)
	}
	e := f.calls[0][0]
	if aws.ToString(e.MessageGroupId) != "a" || aws.ToString(e.MessageDeduplicationId) != big[0].EventID ||
		aws.ToString(e.MessageAttributes["event_type"].StringValue) != "order.created" {
		t.Fatalf("entry = %+v", e)
	}
}

func lens(calls [][]types.PublishBatchRequestEntry) []int {
	var n []int
	for _, c := range calls {
		n = append(n, len(c))
	}
	return n
}

func TestPerEntryResultClassification(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name      string
		code      string
		sender    bool
		permanent bool
	}{
		{"invalid parameter", "InvalidParameter", true, true},
		{"too long", "InvalidParameterValue", true, true},
		{"throttled entry", "Throttled", true, false},
		{"internal error", "InternalError", false, false},
		{"unknown server fault", "Weird", false, false},
		// The same rule as for a whole call: only known codes are
		// permanent; an unknown sender fault is retried (it used to go dead
		// at once while the same code on a whole call was retried).
		{"unknown sender fault", "KMSDisabled", true, false},
		{"batch entry ids", "BatchEntryIdsNotDistinct", true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeSNS{entry: func(e types.PublishBatchRequestEntry) *types.BatchResultErrorEntry {
				if aws.ToString(e.MessageGroupId) == "bad" {
					return &types.BatchResultErrorEntry{Code: aws.String(tc.code), SenderFault: tc.sender, Message: aws.String("nope")}
				}
				return nil
			}}
			p, _ := sns.NewPublisher(f, sns.PublisherConfig{TopicARN: "arn"})
			errs := p.Publish(context.Background(), []outbox.Message{msg("ok1", 1, 10), msg("bad", 2, 10), msg("ok2", 3, 10)})
			if errs[0] != nil || errs[2] != nil {
				t.Fatalf("neighbours failed: %v", errs)
			}
			if errs[1] == nil || envelope.IsPermanent(errs[1]) != tc.permanent {
				t.Fatalf("entry error %v: permanent=%v, want %v", errs[1], envelope.IsPermanent(errs[1]), tc.permanent)
			}
		})
	}
}

func TestWholeCallErrors(t *testing.T) {
	t.Parallel()
	throttle := &smithy.GenericAPIError{Code: "Throttling", Message: "Rate exceeded", Fault: smithy.FaultClient}
	f := &fakeSNS{call: func([]types.PublishBatchRequestEntry) error { return throttle }}
	p, _ := sns.NewPublisher(f, sns.PublisherConfig{TopicARN: "arn"})
	for _, e := range p.Publish(context.Background(), []outbox.Message{msg("a", 1, 10), msg("b", 2, 10)}) {
		if e == nil || envelope.IsPermanent(e) || !errors.As(e, new(smithy.APIError)) {
			t.Fatalf("throttled call: %v, want retryable API error", e)
		}
	}
	// An invalid-parameter failure of a whole call is retried entry by entry,
	// so only the bad entry goes dead.
	bad := &smithy.GenericAPIError{Code: "InvalidParameter", Message: "bad entry", Fault: smithy.FaultClient}
	f = &fakeSNS{call: func(es []types.PublishBatchRequestEntry) error {
		for _, e := range es {
			if aws.ToString(e.MessageGroupId) == "bad" {
				return bad
			}
		}
		return nil
	}}
	p, _ = sns.NewPublisher(f, sns.PublisherConfig{TopicARN: "arn"})
	errs := p.Publish(context.Background(), []outbox.Message{msg("a", 1, 10), msg("bad", 2, 10), msg("c", 3, 10)})
	if errs[0] != nil || errs[2] != nil || !envelope.IsPermanent(errs[1]) {
		t.Fatalf("errs = %v; want only the bad entry permanent", errs)
	}
}

// Two messages of one group in one call go out in order, the second only
// after the first succeeded.
func TestSameGroupKeepsOrder(t *testing.T) {
	t.Parallel()
	f := &fakeSNS{}
	p, _ := sns.NewPublisher(f, sns.PublisherConfig{TopicARN: "arn"})
	errs := p.Publish(context.Background(), []outbox.Message{msg("g", 1, 10), msg("h", 2, 10), msg("g", 3, 10)})
	for _, e := range errs {
		if e != nil {
			t.Fatal(e)
		}
	}
	if len(f.calls) != 2 || aws.ToString(f.calls[1][0].MessageGroupId) != "g" || aws.ToString(f.calls[1][0].MessageDeduplicationId) != msg("g", 3, 0).EventID {
		t.Fatalf("calls = %v; want g#1,h then g#3", lens(f.calls))
	}
	f = &fakeSNS{entry: func(e types.PublishBatchRequestEntry) *types.BatchResultErrorEntry {
		if aws.ToString(e.MessageDeduplicationId) == msg("g", 1, 0).EventID {
			return &types.BatchResultErrorEntry{Code: aws.String("InternalError")}
		}
		return nil
	}}
	p, _ = sns.NewPublisher(f, sns.PublisherConfig{TopicARN: "arn"})
	errs = p.Publish(context.Background(), []outbox.Message{msg("g", 1, 10), msg("g", 3, 10)})
	if errs[0] == nil || !errors.Is(errs[1], sns.ErrPredecessorFailed) || len(f.calls) != 1 {
		t.Fatalf("errs = %v, calls %d; the successor must not be sent after its predecessor failed", errs, len(f.calls))
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]sns.PublisherConfig{
		"no topic":    {},
		"11 entries":  {TopicARN: "a", MaxEntries: 11},
		"bytes > 256": {TopicARN: "a", MaxBatchBytes: 300000},
	} {
		if _, err := sns.NewPublisher(&fakeSNS{}, cfg); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// An event no subscription's filter accepts is published (SNS would take it
// and deliver it nowhere) and reported as unrouted, one line per published
// event, as the broker transports do; a selected or unpublished event is not.
func TestUnselectedEventsAreReportedAsUnrouted(t *testing.T) {
	var buf bytes.Buffer
	topo := topology.Topology{Consumers: []topology.Consumer{
		{Name: "shipping", Filter: map[string][]string{"event_type": {"order.paid"}}},
	}}
	api := &fakeSNS{entry: func(e types.PublishBatchRequestEntry) *types.BatchResultErrorEntry {
		if aws.ToString(e.MessageGroupId) == "g-fails" {
			return &types.BatchResultErrorEntry{Id: e.Id, Code: aws.String("InternalError"), SenderFault: false}
		}
		return nil
	}}
	p, err := sns.NewPublisher(api, sns.PublisherConfig{TopicARN: "arn:aws:sns:us-east-1:000000000000:t.fifo",
		Topology: &topo, Logger: slog.New(slog.NewJSONHandler(&buf, nil))})
	if err != nil {
		t.Fatal(err)
	}
	paid, created, failing := msg("g-paid", 1, 10), msg("g-created", 1, 10), msg("g-fails", 1, 10)
	paid.Attributes = map[string]string{"event_type": "order.paid", "aggregate_type": "order"}
	errs := p.Publish(context.Background(), []outbox.Message{paid, created, failing})
	if errs[0] != nil || errs[1] != nil || errs[2] == nil {
		t.Fatalf("errs = %v, want nil, nil, an error", errs)
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 1 || !strings.Contains(lines[0], transport.UnroutedLogMessage) || !strings.Contains(lines[0], created.EventID) {
		t.Fatalf("log = %q, want one unrouted line for %s only", buf.String(), created.EventID)
	}
}
