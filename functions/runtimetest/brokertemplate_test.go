package runtimetest

import (
	"fmt"
	"sort"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/transport/amqp"
)

// infra reads a RabbitMQ topology file with a parser of its own (the infra
// module does not import the application's transports). The synthesised
// rabbitmq variant must still name exactly the queues the real topology
// gives: every consumer of FIFOBOX_AMQP_TOPOLOGY has a function whose event
// source reads that consumer's queue in the URL's virtual host, and its
// DLQ and backlog alarms watch that consumer's DLQ and queue.
func TestRabbitMQTemplateMatchesTheTopology(t *testing.T) {
	tpls := loadTemplates(t, rabbitmqTemplates)
	fns, tpl := functions(t, tpls)
	raw, _ := fns["dispatcher"].Env["FIFOBOX_AMQP_TOPOLOGY"].(string)
	top, err := amqp.LoadTopology(raw)
	if err != nil {
		t.Fatalf("the dispatcher's FIFOBOX_AMQP_TOPOLOGY: %v", err)
	}
	fnByID := map[string]templateFunction{}
	for _, f := range fns {
		fnByID[f.ID] = f
	}
	wantQueues := map[string]string{} // consumer -> queue
	for _, c := range top.Consumers {
		wantQueues[c.Name] = c.QueueName()
	}
	gotQueues := map[string]string{}
	for id, r := range tpl.Resources {
		if r.Type != "AWS::Lambda::EventSourceMapping" {
			continue
		}
		ref, _ := r.Properties["FunctionName"].(map[string]any)["Fn::GetAtt"].([]any)
		if len(ref) != 2 {
			t.Fatalf("%s: FunctionName %v", id, r.Properties["FunctionName"])
		}
		f, ok := fnByID[ref[0].(string)]
		if !ok {
			t.Fatalf("%s: function %v is not a fifobox function", id, ref[0])
		}
		name, _ := f.Env["FIFOBOX_CONSUMER_NAME"].(string)
		if _, ok := top.Consumer(name); !ok {
			t.Errorf("%s: consumer %q is not in the topology", id, name)
		}
		if f.Env["FIFOBOX_AMQP_TOPOLOGY"] != raw {
			t.Errorf("%s: its function has another topology than the dispatcher", id)
		}
		queues, _ := r.Properties["Queues"].([]any)
		if len(queues) != 1 {
			t.Fatalf("%s: Queues %v", id, queues)
		}
		gotQueues[name] = fmt.Sprint(queues[0])
		for _, a := range r.Properties["SourceAccessConfigurations"].([]any) {
			m := a.(map[string]any)
			if m["Type"] == "VIRTUAL_HOST" && m["URI"] != "/" {
				t.Errorf("%s: VIRTUAL_HOST %v, but the functions' URL has the default virtual host", id, m["URI"])
			}
		}
	}
	if fmt.Sprint(gotQueues) != fmt.Sprint(wantQueues) {
		t.Errorf("event sources read %v, the topology's consumers' queues are %v", gotQueues, wantQueues)
	}

	// The broker alarms: per consumer its queue's backlog and its DLQ.
	var want, got []string
	for _, c := range top.Consumers {
		want = append(want, "MessageReadyCount "+c.QueueName(), "MessageCount "+c.DLQName())
	}
	for _, tp := range tpls {
		for _, r := range tp.Resources {
			if r.Type != "AWS::CloudWatch::Alarm" || r.Properties["Namespace"] != "AWS/AmazonMQ" {
				continue
			}
			for _, d := range r.Properties["Dimensions"].([]any) {
				if m := d.(map[string]any); m["Name"] == "Queue" {
					got = append(got, fmt.Sprint(r.Properties["MetricName"])+" "+fmt.Sprint(m["Value"]))
				}
			}
		}
	}
	sort.Strings(want)
	sort.Strings(got)
	if strings.Join(got, ", ") != strings.Join(want, ", ") {
		t.Errorf("broker alarms watch %v, want %v", got, want)
	}
}
