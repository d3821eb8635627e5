// Package transporttest is the conformance suite every fifobox transport
// runs against its real broker (River's riverdrivertest, Watermill's
// TestPubSub): one set of tests for the guarantees every transport must keep
// the same way (per-aggregate order through a dead-letter and a redrive, a
// poison event holding its aggregate alone, redeliveries applied once, a
// consumer killed and restarted, broker connections cut, the database down
// longer than the retry budget, side effects slower than the broker's
// redelivery timeout, Lambda deadlines), and a Features struct for what
// differs. A transport's test package calls Run from a test and Main from
// its TestMain (the kill test re-executes the test binary as the consumer).
// RunPipeline runs the whole flow (outbox, dispatcher, broker, inbox) on the
// topologies every transport ships (Harness.Preset).
package transporttest

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/fifobox/fifobox/pkg/inbox"
	"github.com/fifobox/fifobox/pkg/outbox"
	"github.com/fifobox/fifobox/pkg/transport"
)

// Harness is one transport under test.
type Harness struct {
	// Name names the transport in test names ("rabbitmq").
	Name string
	// New provisions a fresh, isolated deployment (its own vhost, stream
	// names or queues) with opts' consumers, each receiving every event,
	// and removes it when the test ends.
	New func(t *testing.T, opts Options) Deployment
	// Preset provisions a fresh, isolated deployment of one of the
	// topologies the transport ships, by its Preset name (Holdco.Name, ...),
	// and says where its topology routes events (RunPipeline).
	Preset func(t *testing.T, name string) (Deployment, Routing)
	// Rebuild returns, in a child process, the deployment described by
	// Deployment.Spec.
	Rebuild func(spec string) (Deployment, error)
	// Features says what differs between transports.
	Features Features
}

// Features are what the suite adapts to per transport.
type Features struct {
	// Lambda, if set, runs the transport's Lambda handler over d's
	// consumer the way its event source does (nil: the transport has no
	// Lambda consumer).
	Lambda func(t *testing.T, d Deployment, consumer string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) LambdaSource
	// RedeliveryTimeout says the broker redelivers what a consumer holds
	// unacknowledged after Options.AckWait (JetStream's ack_wait, SQS's
	// visibility timeout): the slow side-effect test then proves the
	// consumer keeps its work alive. False (RabbitMQ): the test still runs.
	RedeliveryTimeout bool
}

// Options shape a deployment.
type Options struct {
	// Consumers each receive every event. Default one, "c1".
	Consumers []string
	// Retry is every consumer's retry policy. Default 2 retries from 100ms.
	Retry transport.RetryPolicy
	// AckWait is how long the broker waits before redelivering what a
	// consumer holds (JetStream ack_wait, SQS visibility timeout); 0: the
	// harness's default for tests.
	AckWait time.Duration
	// Lanes is each consumer's lanes (workers): 4, so that a test holds few
	// database connections.
	Lanes int
}

func (o *Options) defaults() {
	if len(o.Consumers) == 0 {
		o.Consumers = []string{"c1"}
	}
	if o.Lanes == 0 {
		o.Lanes = 4
	}
	if o.Retry == (transport.RetryPolicy{}) {
		o.Retry = transport.RetryPolicy{MaxRetries: 2, InitialDelay: transport.Duration(100 * time.Millisecond),
			Multiplier: 2, MaxDelay: transport.Duration(time.Second)}
	}
}

// Deployment is one provisioned, isolated topology on the real broker.
type Deployment interface {
	// Publisher publishes to every consumer (the dispatcher's publisher).
	Publisher() outbox.Publisher
	// Operations are the transport's operator actions (depths, redrive, replay).
	Operations() transport.Operations
	// Runner is the transport's long-running consumer for consumer.
	Runner(consumer string, db inbox.DB, apply inbox.Apply, cc inbox.ConsumerConfig) (transport.Runner, error)
	// CutConnections drops every broker connection of the deployment's
	// clients at once, as a network cut would (they must reconnect on their
	// own), and returns how many it dropped.
	CutConnections(t *testing.T) int
	// Spec describes the deployment for Rebuild in a child process.
	Spec() string
}

// LambdaSource runs a transport's Lambda handler the way its event source does.
type LambdaSource interface {
	// Invoke receives up to n waiting records of the consumer, runs one
	// invocation of the handler on them under ctx, and settles them as the
	// event source would (SQS: deletes all but the reported failures, which
	// come back; Amazon MQ: acknowledges all on success, returns all on an
	// error). It returns how many records the invocation had.
	Invoke(ctx context.Context, n int) (int, error)
}

// Run runs the whole suite against h, each test in parallel.
func Run(t *testing.T, h Harness) {
	tests := []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		{"StrictOrderThroughDeadLetterAndRedrive", testStrictOrderThroughDeadLetterAndRedrive},
		{"PoisonHeldAloneOthersFlow", testPoisonHeldAlone},
		{"RetryKeepsOrder", testRetryKeepsOrder},
		{"RedeliveryDeduped", testRedeliveryDeduped},
		{"BatchesALanesWaitingEvents", testBatches},
		{"ConsumerKilledAndRestarted", testKilledAndRestarted},
		{"BrokerConnectionCut", testConnectionCut},
		{"DatabaseDownLongerThanRetryBudget", testDatabaseDown},
		{"DatabaseDownAcrossInvocations", testDatabaseDownAcrossInvocations},
		{"CrashLoopSpendsNoRetryBudget", testCrashLoop},
		{"EventKillingTheConsumerIsDeadLettered", testEventKillingTheConsumer},
		{"SideEffectSlowerThanAckWait", testSlowSideEffect},
		{"LambdaDeadline", testLambdaDeadline},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.fn(t, h)
		})
	}
}

// Environment of a child consumer process (testKilledAndRestarted).
const (
	envChild    = "FIFOBOX_TRANSPORTTEST_CHILD"
	envSpec     = "FIFOBOX_TRANSPORTTEST_SPEC"
	envDB       = "FIFOBOX_TRANSPORTTEST_DB"
	envConsumer = "FIFOBOX_TRANSPORTTEST_CONSUMER"
	envDelay    = "FIFOBOX_TRANSPORTTEST_DELAY"
)

// Main is the transport test package's TestMain: in a child consumer
// process (the kill test re-executes the test binary) it runs the consumer
// until killed; otherwise it runs the tests.
func Main(m *testing.M, h Harness) {
	if os.Getenv(envChild) == "1" {
		if err := runChild(h); err != nil {
			fmt.Fprintf(os.Stderr, "transporttest child: %v\n", err)
			os.Exit(2)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}
